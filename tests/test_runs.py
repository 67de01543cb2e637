"""`zpp train` never loses or confuses a run: reused checkpoint directories,
run identity on resume, skipped steps and checkpoint names, damaged
checkpoints, metrics files. Runs go through `run` in this process (the
`zpp train` path after argument parsing; its errors are the UsageErrors
below), all of one small configuration, so that they share compiled steps."""

import dataclasses
import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from zpp_jax import UsageError
from zpp_jax.cli import main
from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import OutputError
from zpp_jax.recipes import RunConfig, run
from zpp_jax.recipes.runs import MetricsSink, OutputLock, cut_metrics

# The smallest run: tiny GPT at 16 tokens, 8 sequences, no evaluation.
BASE = RunConfig(seq_len=16, batch=8, eval_every=0, eval_batches=1, warmup=1, progress=False)


def _run(**kw):
    return run(dataclasses.replace(BASE, **kw))


def _records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _steps(ckpt):
    return sorted(int(p.name) for p in pathlib.Path(ckpt).iterdir() if p.name.isdigit())


@pytest.mark.slow  # training runs
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


@pytest.mark.slow  # training runs
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


@pytest.mark.slow  # training runs
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
from zpp_jax.recipes.train import run

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
    assert all(line.startswith("zpp train: ") for line in err.strip().splitlines()), err[-3000:]
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

    # Every checkpoint damaged: one line each, then the error, no traceback.
    for step in _steps(ckpt):
        for p in (ckpt / str(step)).rglob("*meta*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    capfd.readouterr()
    with pytest.raises(UsageError, match=r"none of the checkpoints \[6, 4, 2\] in .* restores"):
        _run(steps=6, ckpt_every=2, resume=True, **out)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("its metadata is damaged" in line for line in err), err


# -- one writer per run --------------------------------------------------------------


def test_outputs_in_use_are_refused_naming_the_holder(tmp_path):
    """A run whose checkpoint directory or metrics file another run holds
    is refused before it touches either, with the holder named; the lock
    goes with its holder, however that ends (here a SIGKILLed process)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    out = dict(ckpt_dir=str(ckpt), metrics=str(metrics), plot=None)
    (ckpt / "2" / "state").mkdir(parents=True)  # what a checkpoint holds
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    for held in (dict(ckpt_dir=str(ckpt)), dict(metrics=str(metrics))):
        with OutputLock(dataclasses.replace(BASE, **held)), pytest.raises(OutputError) as refused:
            _run(steps=4, resume=True, ckpt_every=1, **out)
        flag = "--ckpt-dir" if "ckpt_dir" in held else "--metrics"
        assert f"{flag} {held.popitem()[1]} is in use by process {os.getpid()} on" in str(
            refused.value
        )
        assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'
        assert sorted(p.name for p in ckpt.iterdir()) == [".zpp-lock", "2"]
        assert [p.name for p in (ckpt / "2").iterdir()] == ["state"]
    # Held by a process that is then SIGKILLed: free again.
    script = (
        "import sys, time\n"
        "from zpp_jax.recipes.runs import OutputLock\n"
        "from zpp_jax.recipes.train import RunConfig\n"
        f"lock = OutputLock(RunConfig(ckpt_dir={str(ckpt)!r}))\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(OutputError, match=f"in use by process {holder.pid} on"):
            OutputLock(dataclasses.replace(BASE, ckpt_dir=str(ckpt)))
        holder.kill()
        holder.wait()
    finally:
        holder.kill()
    OutputLock(dataclasses.replace(BASE, ckpt_dir=str(ckpt))).release()


@pytest.mark.slow
def test_two_runs_started_on_the_same_outputs(tmp_path):
    """Two `zpp train` on one checkpoint directory and metrics file, as a
    user started them: the second is refused with one line naming the
    first, which trains to the end with all its records and checkpoints."""
    args = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0"]
    args += ["--steps", "6", "--ckpt-every", "2", "--warmup", "1"]
    args += ["--ckpt-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl")]
    cmd = [sys.executable, "-m", "zpp_jax", *args]
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / "ck" / ".zpp-lock"
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().startswith("process")):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    finally:
        first.kill()
    assert second.returncode == 2
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and f"is in use by process {first.pid} on" in err[0], err
    assert [r["step"] for r in _records(tmp_path / "m.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert _steps(tmp_path / "ck") == [2, 4, 6]


# -- metrics to streams and special files ---------------------------------------------


@pytest.mark.slow
def test_metrics_stream_to_stdout_and_special_files(tmp_path, capfd):
    """`--metrics -` and `/dev/stdout` put every record on standard output
    (here captured into a file, as `> out.txt` would) and leave
    /dev/stdout a symbolic link; `/dev/full` ends at the first record with
    one line and status 2, reading nothing from the device; a symbolic link
    to a metrics file is kept, its target written."""
    args = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0", "--steps", "2"]
    for target in ("-", "/dev/stdout"):
        capfd.readouterr()
        assert main([*args, "--metrics", target]) == 0
        out = capfd.readouterr().out.splitlines()
        assert [json.loads(line)["step"] for line in out] == [1, 2]
    assert os.path.islink("/dev/stdout")
    assert main([*args, "--metrics", "/dev/full"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        "zpp train: error: --metrics /dev/full: a record could not be written: No space left on "
        "device; the records before it are intact"
    ]
    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert main([*args, "--metrics", str(link)]) == 0
    assert link.is_symlink() and [r["step"] for r in _records(target)] == [1, 2]
    assert (tmp_path / "link.png").is_file()  # the plot beside the name given


# -- a full disk ---------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs with room for one checkpoint of the smallest run (about 1.6 MB)
    and not two, with 0.8 MB to spare either way: compression makes the
    checkpoints' sizes vary a little."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2400k", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_loses_nothing(tmp_path, small_disk, capfd):
    """Checkpoints on a disk that fills at the second one: one line naming
    the directory and the cause, status 2; the half-written checkpoint is
    removed, the first is intact and resumes exactly (on a roomier disk).
    Metrics on a full disk: the file ends in a whole record. A plot that
    cannot be written is a warning, and the run succeeds."""
    args = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0", "--warmup", "1"]
    ckpt, metrics = small_disk / "ck", small_disk / "m.jsonl"
    run_args = [*args, "--steps", "4", "--ckpt-every", "2", "--plot", str(tmp_path / "p.png")]
    assert main([*run_args, "--ckpt-dir", str(ckpt), "--metrics", str(metrics)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        f"zpp train: error: checkpoint 4 could not be written to {ckpt}: No space left on "
        "device; the checkpoints before it are intact"
    ]
    assert _steps(ckpt) == [2] and sorted(p.name for p in ckpt.iterdir()) == [".zpp-lock", "2"]
    assert [r["step"] for r in _records(metrics)] == [1, 2, 3, 4]
    want = [r["loss"] for r in _records(metrics)]
    roomy = tmp_path / "ck"
    shutil.copytree(ckpt, roomy)
    resumed = tmp_path / "resumed.jsonl"
    stopped_at_2 = "".join(line + "\n" for line in metrics.read_text().splitlines()[:2])
    resumed.write_text(stopped_at_2)
    assert main([*run_args, "--ckpt-dir", str(roomy), "--metrics", str(resumed), "--resume"]) == 0
    assert [r["loss"] for r in _records(resumed)] == want

    # A record that fills the disk mid-line is cut back: the file ends in a whole record.
    metrics.unlink()
    first = json.dumps({"step": 1, "pad": "x" * 3000})
    metrics.write_text(first + "\n")
    _fill(small_disk)
    sink = MetricsSink(str(metrics))
    with pytest.raises(OutputError, match="a record could not be written: No space left"):
        sink.write(json.dumps({"step": 2, "pad": "y" * 3000}))
    sink.close()
    assert metrics.read_text() == first + "\n"
    # The plot is best effort: a warning, and the plot there before is kept.
    (small_disk / "fill").unlink()
    (small_disk / "p.png").write_bytes(b"an older plot")
    _fill(small_disk)
    capfd.readouterr()
    assert main([*args, "--steps", "1", "--plot", str(small_disk / "p.png")]) == 0
    err = capfd.readouterr().err
    assert f"zpp train: warning: --plot {small_disk / 'p.png'} not written: No space left" in err
    assert (small_disk / "p.png").read_bytes() == b"an older plot"
    assert not [p.name for p in small_disk.iterdir() if "tmp" in p.name]


def _fill(disk):
    """Write zeros into `disk` until it is full."""
    with open(disk / "fill", "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 65536):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC


# `zpp train` in a child process whose checkpoint directory cannot be created
# at `argv[1]` (as a directory turned read-only mid-run would fail it).
_UNCREATABLE = """
import sys
from orbax.checkpoint._src.path import atomicity
create = atomicity.AtomicRenameTemporaryPath.create
step = sys.argv[1]

async def refused(self, *args, **kwargs):
    if self._final_path.name == step:
        raise PermissionError(13, "Permission denied", str(self._tmp_path))
    return await create(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.create = refused
from zpp_jax.cli import entry
sys.argv = ["zpp", *sys.argv[2:]]
entry()
"""


@pytest.mark.slow
def test_a_save_that_cannot_create_its_directory_ends_at_once(tmp_path):
    """Orbax's writer threads wait 300 s for a step directory that failed
    to be created; `zpp train` reports the failure in one line and exits
    with status 2 without waiting for them (the timeout below only catches
    a hang)."""
    ckpt = tmp_path / "ck"
    args = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0"]
    args += ["--steps", "4", "--ckpt-every", "2", "--ckpt-dir", str(ckpt)]
    r = subprocess.run(
        [sys.executable, "-c", _UNCREATABLE, "4", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"zpp train: error: checkpoint 4 could not be written to {ckpt}: Permission denied "
        f"({ckpt}/4.orbax-checkpoint-tmp); the checkpoints before it are intact"
    ]
    assert _steps(ckpt) == [2]


@pytest.mark.slow
def test_resume_on_another_mesh_says_the_residuals_restart(tmp_path, capfd):
    """Error-feedback residuals are per device: a run resumed on a mesh of
    another shape restarts them from zero, and says so."""
    ckpt = str(tmp_path / "ck")
    zero = ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True)
    _run(steps=2, ckpt_every=2, ckpt_dir=ckpt, zero=zero)
    capfd.readouterr()
    _run(steps=3, ckpt_dir=ckpt, zero=zero, resume=True, nodes=4, local=2)
    assert (
        "--resume: checkpoint 2 was saved on a 2 x 4 mesh, this run is on 4 x 2: the "
        "error-feedback residuals restart from zero" in capfd.readouterr().err
    )


# -- issue-53 paths: what zpp may touch ------------------------------------------------


@pytest.mark.slow  # a training run
def test_outputs_are_checked_before_the_run_and_user_files_kept(tmp_path, capfd):
    """Before anything is built: a checkpoint directory holding the user's
    own folder named like a step (`2023/`) is refused, with or without
    --overwrite, and the folder kept; --plot must be a .png apart from
    --metrics and --ckpt-dir; a --ckpt-dir that is a symbolic link to
    itself is named; the default plot goes beside the metrics even when
    their folder's name has a dot, leaving the user's file there alone."""
    ckpt = tmp_path / "ck"
    (ckpt / "2023").mkdir(parents=True)
    (ckpt / "2023" / "report.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert main(["train", "--quiet", "--ckpt-dir", str(ckpt), *extra]) == 2
        assert "holds 2023, named like a checkpoint step but not one" in capfd.readouterr().err
    assert (ckpt / "2023" / "report.txt").read_text() == "mine"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for argv, message in (
        (["--plot", str(tmp_path / "loss.xyz")], "the plot is a PNG image; give a name ending"),
        (
            ["--metrics", str(tmp_path / "m.png"), "--plot", str(tmp_path / "m.png")],
            "--metrics and --plot are the same path",
        ),
        (
            ["--metrics", str(tmp_path / "x"), "--ckpt-dir", str(tmp_path / "x")],
            "--metrics and --ckpt-dir are the same path",
        ),
        (["--ckpt-dir", str(loop)], "a symbolic link that reaches no directory"),
    ):
        assert main(["train", "--quiet", *argv]) == 2, argv
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    (tmp_path / "run.png").write_bytes(b"the user's")
    metrics = tmp_path / "run.v2" / "metrics"
    args = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0", "--steps", "1"]
    assert main([*args, "--metrics", str(metrics)]) == 0
    assert (tmp_path / "run.v2" / "metrics.png").is_file()
    assert (tmp_path / "run.png").read_bytes() == b"the user's"


def test_api_entry_points_name_the_bad_argument(tmp_path, mesh24):
    """From Python, a bad argument is a UsageError naming it."""
    import optax
    from flax import linen as nn
    from flax import nnx

    from zpp_jax import (
        Checkpointer,
        JitFSDP,
        Trainer,
        ZeroPPConfig,
        hf,
        make_mesh,
        shard,
        shard_linen,
    )
    from zpp_jax.baseline import NoCommunication
    from zpp_jax.data import TokenDataset

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match="config must be a zpp.ZeroPPConfig .* got dict"):
        shard(model, mesh24, config={"hpz": False})
    with pytest.raises(UsageError, match="mesh must be a jax.sharding.Mesh .* got NoneType"):
        shard(model, None)
    with pytest.raises(UsageError, match="gradient_block_size must be at most 16,777,216"):
        ZeroPPConfig(gradient_block_size=2**31)
    tokens = np.arange(1000) % 200
    with pytest.raises(UsageError, match="seq_len must be an int from 1 to"):
        TokenDataset(tokens, seq_len=0)
    with pytest.raises(UsageError, match=r"no split 'test': a TokenDataset has \['train', 'val'\]"):
        TokenDataset(tokens, seq_len=8).batch("test", 0, 4, 0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        Checkpointer(tmp_path / "file")
    with pytest.raises(UsageError, match=r"hf.save: .*file is a file, not a directory"):
        hf.save(model, tmp_path / "file")
    # optax's factory itself, not an optimizer it made: before anything is built
    for make in (Trainer, JitFSDP, NoCommunication):
        with pytest.raises(UsageError, match=r"got function adamw: call it .* adamw\(3e-4\)"):
            make(model, optax.adamw, mesh24)
    with pytest.raises(UsageError, match="optimizer must be an optax.GradientTransformation"):
        Trainer(model, None, mesh24)
    with pytest.raises(UsageError, match=r"= 9 does not match the 8 devices available; .* 8$"):
        make_mesh(3, 3)
    with pytest.raises(UsageError, match="loss_fn must be a function"):
        Trainer(model, optax.sgd(0.1), mesh24, loss_fn="mse")
    for policy in ("blocks", 3, nnx.Linear):
        with pytest.raises(UsageError, match=r"policy=.*: pass a function \(path, module\)"):
            shard(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), mesh24, policy=policy)
    for dtype, message in (
        ("bf16", "'bf16' is not a dtype"),
        ("int8", "must be a floating dtype .* int8"),
    ):
        with pytest.raises(UsageError, match=f"compute_dtype {message}"):
            shard(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), mesh24, compute_dtype=dtype)
    with pytest.raises(UsageError, match="shard_linen takes a Flax Linen module, got Linear"):
        shard_linen(model, {"params": {}}, mesh24)
    with pytest.raises(UsageError, match="'params' collection .* got NoneType"):
        shard_linen(nn.Dense(8), None, mesh24)


@pytest.mark.slow
def test_a_save_over_the_file_size_limit_is_one_line(tmp_path):
    """A checkpoint write refused by the process's file-size limit (EFBIG,
    as `ulimit -f` sets it) is one line naming the cause, status 2."""
    limit = 200_000  # bytes: below a checkpoint's largest file, above the rest
    # The session's compiled programs are read but none is written: a cache
    # entry is a file too, and one over the limit would be a second error.
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1e9"}
    args = ["train", "--quiet", "--seq", "16", "--batch", "8", "--eval-every", "0", "--warmup", "1"]
    args += ["--steps", "2", "--ckpt-every", "2", "--ckpt-dir", str(tmp_path / "ck")]
    limited = (  # the limit set in the child itself (no fork of this threaded process)
        "import os, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'zpp_jax', *sys.argv[1:]])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", limited, *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "checkpoint 2 could not be written to" in err[0], err
    assert "File too large" in err[0] and "the checkpoints before it are intact" in err[0]
