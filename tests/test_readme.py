"""The README and the guide as a user reads them: every Python block runs
as written, and what they say about the package matches the package."""

import importlib
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
# The pages whose code a reader runs: the guide's and the design notes'.
GUIDE = sorted((ROOT / "docs" / "guide").glob("*.md")) + sorted(
    (ROOT / "docs" / "design").glob("*.md")
)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


# (where, block): the README's, then each guide page's, in order.
BLOCKS = [("README.md", b) for b in _python_blocks(README)]
BLOCKS += [(str(p.relative_to(ROOT)), b) for p in GUIDE for b in _python_blocks(p.read_text())]
# A block the README shows and a guide page repeats runs once.
BLOCKS = list({block: (where, block) for where, block in reversed(BLOCKS)}.values())[::-1]


def test_readme_and_guide_have_python_blocks():
    assert len(_python_blocks(README)) >= 1
    assert {where for where, _ in BLOCKS} >= {
        "docs/guide/bring-your-own-model.md",
        "docs/guide/fine-tuning.md",
    }


def test_readme_is_short():
    assert README.count("\n") <= 250


@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(BLOCKS)), ids=[f"{w}[{i}]" for i, (w, _) in enumerate(BLOCKS)]
)
def test_python_block_runs_as_written(tmp_path, index):
    # A fresh interpreter in an empty directory, with none of the test
    # session's device settings: only what the block itself sets.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZPP_", "JAX_NUM_CPU"))}
    r = subprocess.run(
        [sys.executable, "-c", BLOCKS[index][1]],
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
    """Every `zpp.X` / `zpp_jax.X` the README and the guide use is a
    top-level name or a submodule, and every `zpp.sub.X` exists there (no
    deprecated name: those warn)."""
    text = "\n".join(b for _, b in BLOCKS) + README
    for page in GUIDE:
        text += page.read_text()
    used = set(re.findall(r"\bzpp\.([A-Za-z_]\w*)", text))
    used |= set(re.findall(r"`zpp_jax\.([A-Za-z_]\w*)", text))
    submodules = {n for n in dir(zpp_jax) if n not in zpp_jax.__all__}
    assert used <= set(zpp_jax.__all__) | submodules, sorted(used - set(zpp_jax.__all__))
    for module, name in set(re.findall(r"\bzpp(?:_jax)?\.([a-z_]+)\.([A-Za-z_]\w*)", text)):
        if module in submodules and module not in ("models",):
            assert hasattr(importlib.import_module(f"zpp_jax.{module}"), name), (module, name)
    for name in zpp_jax.__all__:
        assert hasattr(zpp_jax, name), name
