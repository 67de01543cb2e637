import argparse
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

from zpp_jax import ZeroPPConfig
from zpp_jax.cli import _config_from_args, build_parser, main
from zpp_jax.errors import Number

TINY_DEMO = ["--steps", "3", "--layers", "2", "--d-model", "32", "--d-ff", "64"]
TINY_DEMO += ["--seq", "8", "--batch", "8"]


@pytest.mark.slow  # the demo's ZeRO-3 run stays in the loop
def test_demo_runs_and_reports_bytes(capsys):
    code = main(["demo", *TINY_DEMO])
    out = capsys.readouterr().out
    assert code == 0
    assert "cross-node traffic" in out and "step    3" in out


def test_demo_zero3_is_the_baseline_it_compares_with(capsys):
    """`zpp demo --zero3` runs the same ZeRO-3 (bf16 wire) as its baseline
    row: both move the same bytes."""
    assert main(["demo", "--zero3", *TINY_DEMO]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {
        name: line.split()[-2:]
        for line in lines
        for name in ("ZeRO-3 (bf16 wire)", "this config")
        if line.strip().startswith(name)
    }
    assert rows["this config"] == rows["ZeRO-3 (bf16 wire)"]
    assert "cross-node traffic: 1.00x" in "\n".join(lines)


def _config(*flags, command="demo"):
    return _config_from_args(build_parser().parse_args([command, *flags]))


def test_technique_flags():
    assert _config() == ZeroPPConfig(comm_dtype="bfloat16")
    cfg = _config("--no-hpz", "--gradient-bits", "8")
    assert cfg == ZeroPPConfig(hpz=False, gradient_bits=8, comm_dtype="bfloat16")
    assert _config("--error-feedback", "--block-size", "128", command="train") == ZeroPPConfig(
        error_feedback=True, block_size=128, comm_dtype="bfloat16"
    )
    # One definition of the baseline, for every command.
    for command in ("demo", "train"):
        assert _config("--zero3", command=command) == ZeroPPConfig.zero3()
    assert ZeroPPConfig.zero3().comm_dtype == "bfloat16"
    assert _config("--zero3", "--comm-dtype", "float32") == ZeroPPConfig.zero3(comm_dtype="float32")
    # The recomputation policy goes with either method.
    assert _config().remat == "dots"
    assert _config("--remat", "full", command="train").remat == "full"
    assert _config("--zero3", "--remat", "none") == ZeroPPConfig.zero3(remat="none")


@pytest.mark.parametrize(
    "flags",
    [
        ["--error-feedback"],
        ["--weight-bits", "4"],
        ["--no-hpz"],
        ["--gradient-block-size", "32", "--no-qgz"],
    ],
)
@pytest.mark.parametrize("command", ["demo", "train"])
def test_zero3_rejects_technique_flags(capsys, command, flags):
    assert main([command, "--zero3", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--zero3 turns every ZeRO++ technique off" in err
    assert all(f in err for f in flags if f.startswith("--"))


@pytest.mark.parametrize(
    "flags, idle",
    [
        (["--no-qwz", "--weight-bits", "4"], "--weight-bits would have no effect: --no-qwz"),
        (["--block-size", "64", "--no-qwz"], "--block-size would have no effect: --no-qwz"),
        (
            ["--no-qgz", "--gradient-bits", "8", "--gradient-rounding", "nearest"],
            "--gradient-bits, --gradient-rounding would have no effect: --no-qgz",
        ),
    ],
)
def test_a_setting_of_a_technique_switched_off_is_refused(capsys, flags, idle):
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and idle in err[0], err


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "zpp_jax", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "demo" in r.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--batch", "6", "--steps", "1"], "must be a multiple of the 8 devices"),
        (["demo", "--nodes", "3", "--local", "4"], "does not match the 8 devices"),
        (
            ["demo", "--block-size", "0"],
            "argument --block-size: must be an int from 1 to 16,777,216",
        ),
        (["demo", "--layers", "-1"], "argument --layers: must be an int from 1 to"),
        (["demo", "--lr", "nan"], "argument --lr: must be a finite number, got nan"),
        (
            ["train", "--batch", "12", "--steps", "1", "--quiet"],
            "global batch 12 must be a multiple of devices x grad_accum = 8 x 1",
        ),
        (["train", "--model", "huge", "--steps", "1", "--quiet"], "unknown model size 'huge'"),
        (["train", "--resume", "--steps", "1", "--quiet"], "need --ckpt-dir"),
        (["train", "--clip", "-1"], "argument --clip: must be a number > 0 (a gradient norm)"),
        (["train", "--lr", "0"], "argument --lr: must be a number > 0 (a learning rate), got 0"),
        (["train", "--resume", "--overwrite", "--ckpt-dir", "d"], "pass one"),
        (["train", "--data", "/nonexistent/corpus.txt", "--quiet"], "no such file"),
        (["train", "--data", "/nonexistent/*.txt", "--quiet"], "the pattern matches no file"),
        (["train", "--tokenizer", "bpe:12", "--quiet"], "N must be an integer from 257 to"),
        (["train", "--metrics", "/", "--quiet"], "--metrics / is a directory"),
        (["train", "--ckpt-dir", "/etc/hostname", "--quiet"], "is a file, not a directory"),
        (
            ["train", "--seed", str(10**30)],
            "argument --seed: must be an int from 0 to 4,294,967,295",
        ),
        (["train", "--batch", str(2**27), "--quiet"], "tokens a step, more than int32 indexing"),
        (["train", "--batch", str(2**20), "--seq", "1024"], "the logits alone take 1,099,511,627"),
        (["train", "--grad-accum", "32", "--quiet"], "--grad-accum 32 splits --batch 16 into more"),
        (["train", "--nodes", str(2**31 - 1)], "CPU devices in one process; XLA:CPU"),
        (["train", "--nodes", "64", "--local", "64"], "= 4,096 CPU devices in one process"),
        (["train", "--stages", "100000"], "--stages x --nodes x --local = 800,000 CPU devices"),
        (["demo", "--nodes", "64", "--local", "64"], "--nodes x --local = 4,096 CPU devices"),
        (["comm", "--nodes", "64", "--local", "64"], "--nodes x --local = 4,096 CPU devices"),
        (["comm", "--seq", "0"], "argument --seq: must be an int from 1 to"),
        (["train", "--block-size", "1048576", "--steps", "1"], "block_size=1,048,576 is larger"),
        (["train", "--tokenizer", "bpe:99999999", "--quiet"], "N must be an integer from 257 to"),
        (["plan", "--layers", "0", "--hidden", "8", "--seq", "8", "--stages", "1"], "--layers"),
        (["comm", "--persistence-threshold", "-1"], "argument --persistence-threshold: must be"),
        (["train", "--steps", "abc"], "argument --steps: 'abc' is not an integer"),
        (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (
            ["profile", "--layers", "1", "--hidden", "8", "--seq", "8", "--lengths", "16"],
            "--seq 8 is shorter than the longest slice after the longest context",
        ),
        (["profile", "--layers", "1", "--hidden", "8", "--out", "/"], "--out / is a directory"),
        (["comm", "--compute-dtype", "float8"], "argument --compute-dtype: invalid choice"),
        (["launch", "--grace", "nan", "--", "train"], "argument --grace: must be a finite number"),
        (["train", "--tp", "3", "--quiet"], "--tp 3 must divide --local 4"),
        (["comm", "--tp", "3"], "--tp 3 must divide --local 4"),
        (
            ["comm", "--tp", "2", "--configs", "zero3", "nocomm"],
            "--tp does not yet combine with nocomm",
        ),
        (["train", "--tp", "2", "--lora", "4", "--quiet"], "--tp does not yet combine with --lora"),
        (["train", "--tp", "2", "--error-feedback"], "does not yet combine with --error-feedback"),
        (
            ["train", "--tp", "4", "--arch", "llama", "--quiet"],
            "degree of 4 does not divide the model's 4 query and 2 key-value heads",
        ),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert re.match(r"zpp( \w+)?: error: ", err), err


def test_internal_errors_keep_their_traceback(monkeypatch):
    """A ValueError that is not bad input, here one JAX raises while tracing
    the layer, propagates with its traceback instead of becoming exit 2."""
    import zpp_jax.cli.demo

    def broken_block(params, x):
        return jnp.split(x, 7, axis=-1)[0]  # 32 features do not split into 7

    monkeypatch.setattr(zpp_jax.cli.demo, "block", broken_block)
    with pytest.raises(ValueError, match="equal division") as info:
        main(["demo", *TINY_DEMO])
    assert not isinstance(info.value, zpp_jax.UsageError)


# What each subcommand needs besides the flag under test to parse.
_NEEDS = {"plan": ["--seq", "64", "--stages", "2"]}


def _numeric_flags():
    """(subcommand, flag, its type) for every flag of every subcommand that
    takes a number; `choices` flags name their values instead."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, sub in commands.choices.items():
        for action in sub._actions:
            if action.option_strings and action.type is not None and not action.choices:
                yield command, action.option_strings[0], action.type


def test_every_numeric_flag_is_checked_by_the_parser(capsys):
    """The rule, for every subcommand's numeric flags, new ones included:
    each takes a `zpp_jax.errors.Number` (a range, written once), and 0,
    -1, NaN and a huge value are each either in its range or refused
    before any work with one line naming the flag, status 2."""
    flags = list(_numeric_flags())
    assert len(flags) > 40
    for command, flag, kind in flags:
        assert isinstance(kind, Number), f"zpp {command} {flag} takes {kind}: give it a Number"
        for value in ("0", "-1", "nan", str(10**30)):
            try:
                kind(value)
                continue  # in range: the flag takes it
            except argparse.ArgumentTypeError:
                pass
            assert main([command, *_NEEDS.get(command, []), flag, value]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"zpp {command}: error: argument {flag}"), (
                err
            )
