"""SIGTERM (a cluster taking the machine back) and SIGINT (Ctrl-C) stop
`zpp train` after its current step with a checkpoint, and `--resume` then
loses no step. Runs are real `python -m zpp_jax train` subprocesses; the
uninterrupted run to equal is `run` in this process."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from zpp_jax.preemption import Stopped, StopRequest
from zpp_jax.recipes import RunConfig, run

ARGS = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0", "--warmup", "1"]
STEPS = 12


def _records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _signalled(cmd, metrics, at_step, signals, env=None):
    """Run `cmd`; once `metrics` holds `at_step` records, send `signals`
    to it 0.05 s apart. Returns (status, stderr)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= at_step):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never reached the step"
            time.sleep(0.02)
        for s in signals:
            if proc.poll() is None:
                proc.send_signal(s)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


def _checkpoints(ckpt):
    return sorted(int(p.name) for p in pathlib.Path(ckpt).iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_signals_stop_after_a_step_with_a_checkpoint_and_resume_exactly(tmp_path):
    """SIGTERM, then SIGTERM again while stopping: the run finishes its step,
    saves it (no periodic checkpoint would have: --ckpt-every 1000) and
    exits 143 with one line saying what it saved. Resumed, a SIGINT stops it
    the same way (130). Resumed again, it ends with every step recorded once
    and the losses of an uninterrupted run, bit for bit."""
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "zpp_jax", *ARGS, "--steps", str(STEPS), "--ckpt-every", "1000"]
    cmd += ["--ckpt-dir", str(ckpt), "--metrics", str(metrics)]

    status, err = _signalled(cmd, metrics, 3, [signal.SIGTERM, signal.SIGTERM])
    first = len(_records(metrics))
    assert status == 128 + signal.SIGTERM and 3 <= first < STEPS, err
    assert _checkpoints(ckpt) == [first]
    assert f"zpp train: stopped by SIGTERM after step {first}: checkpoint {first} saved" in err
    assert "zpp: SIGTERM: stopping after the current step" in err
    assert "Traceback" not in err

    status, err = _signalled([*cmd, "--resume"], metrics, first + 2, [signal.SIGINT])
    second = len(_records(metrics))
    assert status == 128 + signal.SIGINT and first + 2 <= second < STEPS, err
    assert _checkpoints(ckpt) == [first, second]
    assert f"stopped by SIGINT after step {second}: checkpoint {second} saved" in err
    assert "Traceback" not in err and "val_loss nan" not in err

    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = _records(metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    want = run(RunConfig(seq_len=16, batch=8, eval_every=0, warmup=1, steps=STEPS, progress=False))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_a_stop_request_records_the_first_signal_and_restores_handlers(capfd):
    """In-process: the first signal is recorded and reported, a second is
    reported and changes nothing, and the handlers before are put back."""
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is before
    err = capfd.readouterr().err
    assert "zpp: SIGINT: stopping after the current step" in err
    assert "zpp: SIGTERM again: still stopping" in err
    stopped = Stopped(signal.SIGTERM, 7, "checkpoint 7 saved")
    assert stopped.exit_status == 143
    assert str(stopped) == "stopped by SIGTERM after step 7: checkpoint 7 saved"
