"""The README as a user reads it: every Python block runs as written, and
what it says about the package matches the package."""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import zpp_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs_as_written(tmp_path, index):
    # A fresh interpreter in an empty directory, with none of the test
    # session's device settings: only what the block itself sets.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZPP_", "JAX_NUM_CPU"))}
    r = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loss" in r.stdout


def test_python_version_is_the_one_pyproject_requires():
    with open(ROOT / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["project"]["requires-python"]
    version = re.fullmatch(r">=(\d+\.\d+)", requires).group(1)
    stated = set(re.findall(r"Python (3\.\d+)", README))
    assert stated == {version}, (stated, requires)


def test_public_names_the_readme_uses_are_exported():
    used = set(re.findall(r"\bzpp\.([A-Za-z_]\w*)", "\n".join(BLOCKS)))
    used |= set(re.findall(r"`zpp_jax\.([A-Za-z_]\w*)", README))
    assert used <= set(zpp_jax.__all__), sorted(used - set(zpp_jax.__all__))
    for name in zpp_jax.__all__:
        assert hasattr(zpp_jax, name), name
    # the README tells multi-host users to call it
    assert zpp_jax.initialize is zpp_jax.distributed.initialize
