import subprocess
import sys

import jax.numpy as jnp
import pytest

from zpp_jax import ZeroPPConfig
from zpp_jax.cli import _config_from_args, build_parser, main

TINY_DEMO = ["--steps", "3", "--layers", "2", "--d-model", "32", "--d-ff", "64"]
TINY_DEMO += ["--seq", "8", "--batch", "8"]


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


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "zpp_jax", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "demo" in r.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--batch", "6", "--steps", "1"], "must be a multiple of the 8 devices"),
        (["demo", "--nodes", "3", "--local", "4"], "does not match the 8 devices"),
        (["demo", "--block-size", "0"], "block_size must be a positive int"),
        (["demo", "--batch", "0"], "--batch must be positive, got 0"),
        (["demo", "--d-model", "0"], "--d-model must be positive, got 0"),
        (["demo", "--seq", "0"], "--seq must be positive, got 0"),
        (["demo", "--layers", "0"], "--layers must be positive, got 0"),
        (["demo", "--layers", "-1"], "--layers must be positive, got -1"),
        (["demo", "--nodes", "0"], "nodes must be a positive int, got 0"),
        (["demo", "--lr", "nan"], "--lr must be a positive finite learning rate"),
        (
            ["train", "--batch", "12", "--steps", "1", "--quiet"],
            "global batch 12 must be a multiple of devices x grad_accum = 8 x 1",
        ),
        (["train", "--model", "huge", "--steps", "1", "--quiet"], "unknown model size 'huge'"),
        (["train", "--resume", "--steps", "1", "--quiet"], "need --ckpt-dir"),
        (["train", "--clip", "-1", "--quiet"], "--clip must be a positive finite gradient norm"),
        (["train", "--clip", "nan", "--quiet"], "--clip must be a positive finite gradient norm"),
        (["train", "--lr", "nan", "--quiet"], "--lr must be a positive finite learning rate"),
        (["train", "--lr", "0", "--quiet"], "--lr must be a positive finite learning rate"),
        (["train", "--seq", "0", "--quiet"], "--seq must be a positive number of tokens"),
        (["train", "--warmup", "-1", "--quiet"], "--warmup must be an int from 0 to 2,147,483,647"),
        (["train", "--seed", "-1", "--quiet"], "--seed must be an int from 0 to 4,294,967,295"),
        (["train", "--seed", str(10**30), "--quiet"], "--seed must be an int from 0 to"),
        (["train", "--steps", str(10**30), "--quiet"], "--steps must be an int from 1 to"),
        (["train", "--batch", str(2**33), "--quiet"], "--batch must be an int from 1 to"),
        (["train", "--batch", str(2**27), "--quiet"], "tokens a step, more than int32 indexing"),
        (["train", "--ckpt-every", str(10**30), "--quiet"], "--ckpt-every must be an int from 0"),
        (["train", "--eval-every", str(10**30), "--quiet"], "--eval-every must be an int from 0"),
        (["train", "--grad-accum", "32", "--quiet"], "--grad-accum must be an int from 1 to 16"),
        (["train", "--nodes", str(10**30), "--quiet"], "CPU devices in one process; XLA:CPU"),
        (["train", "--nodes", "64", "--local", "64"], "= 4,096 CPU devices in one process"),
        (["train", "--stages", str(10**30), "--quiet"], "--stages x --nodes x --local = "),
        (["demo", "--nodes", "64", "--local", "64"], "--nodes x --local = 4,096 CPU devices"),
        (["comm", "--nodes", "64", "--local", "64"], "--nodes x --local = 4,096 CPU devices"),
        (["comm", "--seq", "0"], "--seq must be a positive number of tokens, got 0"),
        (["train", "--gradient-block-size", str(10**30)], "gradient_block_size must be at most"),
        (["train", "--block-size", "1048576", "--steps", "1"], "block_size=1,048,576 is larger"),
        (["train", "--tokenizer", "bpe:99999999", "--quiet"], "N must be an integer from 257 to"),
        (["train", "--resume", "--overwrite", "--ckpt-dir", "d"], "pass one"),
        (["train", "--data", "/nonexistent/corpus.txt", "--quiet"], "no such file"),
        (["train", "--data", "/nonexistent/*.txt", "--quiet"], "the pattern matches no file"),
        (["train", "--tokenizer", "bpe:12", "--quiet"], "N must be an integer from 257 to"),
        (["train", "--metrics", "/", "--quiet"], "--metrics / is a directory"),
        (["train", "--ckpt-dir", "/etc/hostname", "--quiet"], "is a file, not a directory"),
        (["plan", "--layers", "0", "--hidden", "8", "--seq", "8", "--stages", "1"], "--layers"),
        (["comm", "--persistence-threshold", "-1"], "persistence_threshold must be an int >= 0"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("zpp ")


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
