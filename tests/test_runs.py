"""`zpp train` never loses or confuses a run: reused checkpoint directories,
run identity on resume, skipped steps and checkpoint names, damaged
checkpoints, metrics files. Runs go through `run` in this process (the
`zpp train` path after argument parsing; its errors are the UsageErrors
below), all of one small configuration, so that they share compiled steps."""

import dataclasses
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from zpp_jax import UsageError
from zpp_jax.cli.runs import cut_metrics
from zpp_jax.cli.train import RunConfig, run

# The smallest run: tiny GPT at 16 tokens, 8 sequences, no evaluation.
BASE = RunConfig(seq_len=16, batch=8, eval_every=0, eval_batches=1, warmup=1, progress=False)


def _run(**kw):
    return run(dataclasses.replace(BASE, **kw))


def _records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _steps(ckpt):
    return sorted(int(p.name) for p in pathlib.Path(ckpt).iterdir() if p.name.isdigit())


def test_a_directory_of_another_run_is_not_reused(tmp_path, capfd):
    """Case 1: another run's checkpoints and metrics are neither deleted nor
    resumed by mistake. Without --resume the run refuses to start (and
    truncates nothing); --resume with other settings says what differs;
    --overwrite deletes, and says what."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    out = dict(ckpt_dir=str(ckpt), metrics=str(metrics), plot=None)
    _run(steps=3, ckpt_every=1, seed=7, **out)
    assert _steps(ckpt) == [1, 2, 3]
    saved = metrics.read_text()

    with pytest.raises(UsageError) as again:
        _run(steps=5, ckpt_every=2, **out)
    err = str(again.value)
    assert "holds checkpoints [1, 2, 3]" in err and "holds 3 records" in err
    assert "pass --resume to continue that run, --overwrite to delete them" in err
    assert metrics.read_text() == saved and _steps(ckpt) == [1, 2, 3]

    with pytest.raises(UsageError) as other:
        _run(steps=5, resume=True, seed=8, lr=0.001, **out)
    err = str(other.value)
    assert "checkpoint 3" in err and "is of another run" in err
    assert "lr: 0.003 -> 0.001" in err and "seed: 7 -> 8" in err
    assert metrics.read_text() == saved and _steps(ckpt) == [1, 2, 3]

    capfd.readouterr()
    _run(steps=2, ckpt_every=2, overwrite=True, **out)
    assert "--overwrite: deleted --ckpt-dir" in capfd.readouterr().err
    assert _steps(ckpt) == [2]
    assert [r["step"] for r in _records(metrics)] == [1, 2]


def test_skipped_steps_do_not_collide_and_leave_the_state(tmp_path):
    """Case 2 and the update check: once the warmup has passed, a learning
    rate that overflows float16 parameters makes the updates non-finite, so
    those steps are skipped (and the optimizer's step count stays). The
    checkpoints are named by batches consumed, so they still land at 2, 4
    and 5 instead of colliding."""
    ckpt = tmp_path / "ckpt"
    records = _run(steps=5, lr=1e30, compute_dtype="float16", ckpt_dir=str(ckpt), ckpt_every=2)
    skipped = [x["skipped"] for x in records]
    assert skipped[-3:] == [1, 1, 1], skipped
    assert _steps(ckpt) == [2, 4, 5]


def test_resume_from_nothing_or_past_the_end_says_so(tmp_path, capfd):
    """Case 6: --resume on an empty directory starts a new run and says so;
    on a checkpoint at --steps it has nothing to do and says so; past
    --steps it refuses."""
    ckpt = str(tmp_path / "none")
    _run(steps=2, ckpt_dir=ckpt, resume=True)
    err = capfd.readouterr().err
    assert "--resume: no checkpoint in" in err and "starting a new run" in err
    assert _run(steps=2, ckpt_dir=ckpt, resume=True) == []
    assert "--resume: checkpoint 2 is the last step (--steps 2)" in capfd.readouterr().err
    with pytest.raises(UsageError, match=r"checkpoint 2 in .* is past --steps 1; pass --steps"):
        _run(steps=1, ckpt_dir=ckpt, resume=True)


def test_cut_metrics_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    path.write_text("\n".join(lines) + '\n{"step": 7, "lo')  # the last cut short by a crash
    cut_metrics(str(path), 4)
    assert [r["step"] for r in _records(path)] == [1, 2, 3, 4]


# Runs `run` in a child process that holds checkpoint `argv[1]` just before
# orbax's rename commits it (its arrays and metadata written to the temporary
# directory), touches `argv[2]` and waits there to be killed.
_HELD_SAVE = """
import dataclasses, json, pathlib, sys, time
from orbax.checkpoint._src.path import atomicity
sys.path.insert(0, {tests!r})
from test_runs import BASE
from zpp_jax.cli.train import run

stop, marker, kw = sys.argv[1], pathlib.Path(sys.argv[2]), json.loads(sys.argv[3])
commit = atomicity.AtomicRenameTemporaryPath.finalize

async def held(self):
    if self._final_path.name == stop:
        marker.touch()
        time.sleep(600)
    await commit(self)

atomicity.AtomicRenameTemporaryPath.finalize = held
run(dataclasses.replace(BASE, **kw))
"""


def _sigkill_during_save(step, marker, **kw):
    """A run SIGKILLed while checkpoint `step` is being written."""
    script = _HELD_SAVE.format(tests=str(pathlib.Path(__file__).parent))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(step), str(marker), json.dumps(kw)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the save was never reached"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_killed_save_and_damaged_checkpoint_resume_exactly(tmp_path, capfd):
    """Case 3 and two fault runs. A run is SIGKILLed in the middle of saving
    checkpoint 6, and the latest complete checkpoint, 4, is then damaged (a
    data file cut short; later its metadata deleted). --resume continues
    from the newest intact checkpoint, 2, says which it skipped, deletes
    nothing, and ends with the losses of an uninterrupted run and no step
    recorded twice."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    out = dict(ckpt_dir=str(ckpt), metrics=str(metrics), plot=None)
    _sigkill_during_save(6, tmp_path / "held", steps=6, ckpt_every=2, **out)
    assert _steps(ckpt) == [2, 4]
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("6.")]  # the half-written save
    # Step 6 is recorded before its checkpoint is saved (the other order
    # could lose the record of a saved step); resume cuts it back. Up to
    # the kill the run was never interrupted: its losses are the ones to
    # reach again.
    assert [r["step"] for r in _records(metrics)] == [1, 2, 3, 4, 5, 6]
    want = [r["loss"] for r in _records(metrics)]
    # Damage step 4: cut one of its array files to half.
    files = [p for p in (ckpt / "4").rglob("*") if p.is_file() and p.stat().st_size > 1000]
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])

    capfd.readouterr()
    _run(steps=6, ckpt_every=2, resume=True, **out)
    err = capfd.readouterr().err
    assert "skipping checkpoint 4, it is damaged" in err
    assert "restored checkpoint 2 (skipped damaged [4]; kept on disk as 4.damaged)" in err
    # Nothing deleted: the damaged step is set aside, and saved again.
    assert (ckpt / "4.damaged").is_dir() and _steps(ckpt) == [2, 4, 6]
    got = _records(metrics)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in got] == want

    # Step 4's metadata gone as well: skipped for that reason.
    for p in (ckpt / "4").rglob("*meta*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (ckpt / "6").rename(tmp_path / "six")
    _run(steps=6, ckpt_every=2, resume=True, **out)
    err = capfd.readouterr().err
    assert "skipping checkpoint 4, its metadata is damaged" in err
    assert "kept on disk as 4.damaged-2" in err
    assert [r["loss"] for r in _records(metrics)] == want
