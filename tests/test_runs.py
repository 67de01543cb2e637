"""`zpp train` never loses or confuses a run: reused checkpoint directories,
run identity on resume, skipped steps and checkpoint names, damaged
checkpoints, metrics files. Each run is a real `python -m zpp_jax train`."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from zpp_jax.cli.runs import cut_metrics

# The smallest run: tiny GPT at 16 tokens, 8 sequences, no evaluation.
BASE = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0"]
BASE += ["--eval-batches", "1", "--warmup", "1"]


def _zpp(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZPP_")}
    env["JAX_NUM_CPU_DEVICES"] = "8"
    return subprocess.run(
        [sys.executable, "-m", "zpp_jax", *BASE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _steps(ckpt):
    return sorted(int(p.name) for p in pathlib.Path(ckpt).iterdir() if p.name.isdigit())


def test_a_directory_of_another_run_is_not_reused(tmp_path):
    """Case 1: another run's checkpoints and metrics are neither deleted nor
    resumed by mistake. Without --resume the run refuses to start (and
    truncates nothing); --resume with other settings says what differs;
    --overwrite deletes, and says what."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    out = ["--ckpt-dir", str(ckpt), "--metrics", str(metrics)]
    first = _zpp("--steps", "3", "--ckpt-every", "1", "--seed", "7", *out)
    assert first.returncode == 0, first.stderr[-2000:]
    assert _steps(ckpt) == [1, 2, 3]
    saved = metrics.read_text()

    again = _zpp("--steps", "5", "--ckpt-every", "2", *out)
    assert again.returncode == 2
    err = again.stderr.strip().splitlines()
    assert len(err) == 1 and "holds checkpoints [1, 2, 3]" in err[0] and "holds 3 records" in err[0]
    assert "pass --resume to continue that run, --overwrite to delete them" in err[0]
    assert metrics.read_text() == saved and _steps(ckpt) == [1, 2, 3]

    other = _zpp("--steps", "5", "--resume", "--seed", "8", "--lr", "0.001", *out)
    assert other.returncode == 2
    assert "checkpoint 3" in other.stderr and "is of another run" in other.stderr
    assert "lr: 0.003 -> 0.001" in other.stderr and "seed: 7 -> 8" in other.stderr
    assert metrics.read_text() == saved and _steps(ckpt) == [1, 2, 3]

    fresh = _zpp("--steps", "2", "--ckpt-every", "2", "--overwrite", *out)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert "--overwrite: deleted --ckpt-dir" in fresh.stderr
    assert _steps(ckpt) == [2]
    assert [r["step"] for r in _records(metrics)] == [1, 2]


def test_skipped_steps_do_not_collide_and_leave_the_state(tmp_path):
    """Case 2 and the update check: once the warmup has passed, a learning
    rate that overflows float16 parameters makes the updates non-finite, so
    those steps are skipped (and the optimizer's step count stays). The
    checkpoints are named by batches consumed, so they still land at 2, 4
    and 5 instead of colliding."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    r = _zpp(
        "--steps", "5", "--lr", "1e30", "--compute-dtype", "float16",
        "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--metrics", str(metrics),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    skipped = [x["skipped"] for x in _records(metrics)]
    assert skipped[-3:] == [1, 1, 1], skipped
    assert _steps(ckpt) == [2, 4, 5]


def test_resume_from_nothing_says_so(tmp_path):
    r = _zpp("--steps", "1", "--ckpt-dir", str(tmp_path / "none"), "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--resume: no checkpoint in" in r.stderr and "starting a new run" in r.stderr


def test_cut_metrics_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    path.write_text("\n".join(lines) + '\n{"step": 7, "lo')  # the last cut short by a crash
    cut_metrics(str(path), 4)
    assert [r["step"] for r in _records(path)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_damaged_or_half_saved_checkpoints_resume_exactly(tmp_path):
    """Case 3 and the fault runs: the latest checkpoint damaged (a data file
    cut short, or its metadata gone), or a save killed half-way (orbax's
    temporary directory left behind, metrics written past the last
    checkpoint): --resume continues from the newest intact checkpoint,
    says which it skipped, deletes nothing, and ends with the losses of an
    uninterrupted run and no step recorded twice."""
    ref_metrics = tmp_path / "ref.jsonl"
    ref = _zpp("--steps", "6", "--metrics", str(ref_metrics))
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = [r["loss"] for r in _records(ref_metrics)]

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    out = ["--ckpt-dir", str(ckpt), "--metrics", str(metrics)]
    part = _zpp("--steps", "4", "--ckpt-every", "2", *out)
    assert part.returncode == 0, part.stderr[-2000:]
    assert _steps(ckpt) == [2, 4]
    # Damage step 4: cut one of its array files to half.
    files = [p for p in (ckpt / "4").rglob("*") if p.is_file() and p.stat().st_size > 1000]
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    # A save of step 6 killed half-way: its temporary directory, and the
    # metrics of steps 5 and 6 already written.
    shutil.copytree(ckpt / "2", ckpt / "6.orbax-checkpoint-tmp-1234")
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n" + '{"step": 6, "lo')

    resumed = _zpp("--steps", "6", "--resume", *out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipping checkpoint 4, it is damaged" in resumed.stderr
    assert "restored checkpoint 2 (skipped damaged [4]; kept on disk)" in resumed.stderr
    assert (ckpt / "4").exists()  # nothing deleted
    got = _records(metrics)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in got] == want

    # Step 4's metadata gone as well: skipped for that reason.
    for p in (ckpt / "4").rglob("*meta*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (ckpt / "6").rename(tmp_path / "six")
    again = _zpp("--steps", "6", "--resume", *out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "skipping checkpoint 4" in again.stderr
    assert [r["loss"] for r in _records(metrics)] == want
