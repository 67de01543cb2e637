"""The README and the guide as a user reads them: every Python block runs
as written, and what they say about the package matches the package."""

import importlib
import importlib.util
import os
import pathlib
import re
import shlex
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


def test_ci_runs_the_readme_test_command_as_written():
    """`.ci/run` runs the README's test command, word for word, with
    `python3` a Python the package supports."""
    tests = re.search(r"^Run the tests.*?^```bash\n(.*?)\n```", README, re.S | re.M).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.startswith("python3 -m venv .venv && ") and tests in ci.splitlines()
    assert 'ln -s "$python" "$bin/python3"' in ci


def test_public_names_the_readme_uses_are_exported():
    """Every `zpp.X` / `zpp_jax.X` the README and the guide use is a
    top-level name or a submodule, and every `zpp.sub.X` exists there (no
    deprecated name: those warn)."""
    text = "\n".join(b for _, b in BLOCKS) + README
    for page in GUIDE:
        text += page.read_text()
    used = set(re.findall(r"\bzpp\.([A-Za-z_]\w*)", text))
    used |= set(re.findall(r"`zpp_jax\.([A-Za-z_]\w*)", text))
    # Whether a submodule is imported yet depends on what ran before: ask
    # whether it exists.
    submodules = {n for n in used if importlib.util.find_spec(f"zpp_jax.{n}") is not None}
    assert used <= set(zpp_jax.__all__) | submodules, sorted(used - set(zpp_jax.__all__))
    for module, name in set(re.findall(r"\bzpp(?:_jax)?\.([a-z_]+)\.([A-Za-z_]\w*)", text)):
        if module in submodules and module not in ("models",):
            assert hasattr(importlib.import_module(f"zpp_jax.{module}"), name), (module, name)
    for name in zpp_jax.__all__:
        assert hasattr(zpp_jax, name), name


def _zpp_commands(text: str) -> list[list[str]]:
    """The argument lists of every `zpp` command in a page's shell blocks
    (continuation lines joined, comments dropped, `&&` chains split)."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                words = shlex.split(part)
                for start in ("zpp", "zpp_jax"):
                    if start in words and (start == "zpp" or words[words.index(start) - 1] == "-m"):
                        out.append(words[words.index(start) + 1 :])
    return out


COMMANDS = [
    (str(p.relative_to(ROOT)), argv)
    for p in [ROOT / "README.md", *GUIDE]
    for argv in _zpp_commands(p.read_text())
]


def test_the_guide_shows_zpp_commands():
    assert {argv[0] for _, argv in COMMANDS} >= {"train", "launch", "comm", "tune", "export"}


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[" ".join(a)[:60] for _, a in COMMANDS])
def test_every_zpp_command_shown_is_accepted(where, argv, tmp_path, monkeypatch):
    """Every `zpp` command line of the README and the guide parses with the
    command's own parser and passes its checks that need no device or
    file, so a flag renamed or removed fails here. (Running them needs
    GPUs, several hosts, checkpoints or minutes; the main job and the
    tests are what CI runs.)"""
    from zpp_jax.cli import _run_config, build_parser
    from zpp_jax.config import ZeroPPConfig
    from zpp_jax.fields import given_flags
    from zpp_jax.recipes.tune import TuneConfig

    monkeypatch.chdir(tmp_path)
    ZeroPPConfig().to_file("zpp_tuned.json")  # what `zpp tune` writes, for --config
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        inner = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if inner[:1] != ["python"]:
            args = build_parser().parse_args(inner)
    if args.command == "train":
        _run_config(args)
    elif args.command == "tune":
        TuneConfig(**given_flags(TuneConfig, args))
