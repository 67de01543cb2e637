import subprocess
import sys

from zpp_jax.cli import build_parser, main


def test_demo_runs_and_reports_bytes(capsys):
    code = main(
        [
            "demo",
            "--steps",
            "3",
            "--layers",
            "2",
            "--d-model",
            "32",
            "--d-ff",
            "64",
            "--seq",
            "8",
            "--batch",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "cross-node traffic" in out and "step    3" in out


def test_bad_flags_give_a_clear_error(capsys):
    assert main(["demo", "--batch", "6", "--steps", "1"]) == 2
    assert "must be a multiple of the 8 devices" in capsys.readouterr().err
    assert main(["demo", "--nodes", "3", "--local", "4"]) == 2
    assert "does not match the 8 devices" in capsys.readouterr().err


def test_technique_flags():
    args = build_parser().parse_args(["demo", "--no-hpz", "--gradient-bits", "8"])
    from zpp_jax.cli import _config_from_args

    cfg = _config_from_args(args)
    assert cfg.quantize_weights and not cfg.hpz and cfg.gradient_bits == 8
    assert not _config_from_args(build_parser().parse_args(["demo", "--zero3"])).quantize_weights


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "zpp_jax", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "demo" in r.stdout


def test_train_bad_flags_give_a_clear_error(capsys):
    assert main(["train", "--batch", "12", "--steps", "1", "--quiet"]) == 2
    assert "global batch 12 must be a multiple of devices x grad_accum = 8 x 1" in (
        capsys.readouterr().err
    )
    assert main(["train", "--model", "huge", "--steps", "1", "--quiet"]) == 2
    assert "unknown model size 'huge'" in capsys.readouterr().err
    assert main(["train", "--resume", "--steps", "1", "--quiet"]) == 2
    assert "need --ckpt-dir" in capsys.readouterr().err
