"""Several processes as several nodes (jax.distributed, gloo over TCP), and
losing one of them. Each process is a real `python -m zpp_jax` subprocess."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from zpp_jax.checkpoint import Checkpointer
from zpp_jax.distributed import DistributedConfig
from zpp_jax.launch import free_port, process_env
from zpp_jax.train_gpt import RunConfig, make_trainer

TRAIN = ["train", "--quiet", "--error-feedback", "--eval-every", "0"]
ZERO = dict(error_feedback=True)


def _single_env():
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("ZPP_"):
            del env[k]
    env["JAX_NUM_CPU_DEVICES"] = "8"
    return env


def _zpp(args, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "zpp_jax", *args],
        env=env or _single_env(),
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )


def _losses(path):
    return [json.loads(line)["loss"] for line in pathlib.Path(path).read_text().splitlines()]


def _final_state(ckpt_dir, steps):
    from zpp_jax.config import ZeroPPConfig

    cfg = RunConfig(zero=ZeroPPConfig(comm_dtype="bfloat16", **ZERO), steps=steps)
    trainer = make_trainer(cfg)
    state, meta = Checkpointer(ckpt_dir).restore(trainer)
    assert not meta["residuals_reset"]
    return jax.tree.map(np.asarray, state)


def _assert_states_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_distributed_config_from_env(monkeypatch):
    monkeypatch.setenv("ZPP_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("ZPP_NUM_PROCESSES", "2")
    monkeypatch.setenv("ZPP_PROCESS_ID", "1")
    monkeypatch.setenv("ZPP_HEARTBEAT_TIMEOUT", "7")
    cfg = DistributedConfig.from_env()
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("10.0.0.1:1234", 2, 1)
    assert cfg.heartbeat_timeout == 7 and cfg.is_multi_process
    monkeypatch.setenv("ZPP_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="process_id"):
        DistributedConfig.from_env()
    monkeypatch.setenv("ZPP_PROCESS_ID", "x")
    with pytest.raises(ValueError, match="ZPP_PROCESS_ID must be an integer"):
        DistributedConfig.from_env()
    with pytest.raises(ValueError, match="coordinator_address"):
        DistributedConfig(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        DistributedConfig(heartbeat_timeout=0)
    assert not DistributedConfig().is_multi_process


def test_launch_equals_one_process_and_restores_in_one_process(tmp_path):
    """`zpp launch --nodes 2 -- train` (2 processes x 4 devices) against
    `zpp train` (one process, 2 x 4 devices): same losses, same final state,
    all techniques on (qwZ, hpZ, qgZ, error feedback)."""
    args = [*TRAIN, "--steps", "10"]
    one = _zpp(
        [*args, "--metrics", str(tmp_path / "one.jsonl"), "--ckpt-dir", str(tmp_path / "c1")]
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = _zpp(
        [
            "launch",
            "--nodes",
            "2",
            "--",
            *args,
            "--metrics",
            str(tmp_path / "two.jsonl"),
            "--ckpt-dir",
            str(tmp_path / "c2"),
        ],
    )
    assert two.returncode == 0, two.stderr[-3000:]
    # Not bitwise: the loss mean and the clipping norm are all-reduces, which
    # gloo sums in another order than the in-process collectives (the
    # gradient reduction itself is an all-to-all plus fixed-order local sums).
    np.testing.assert_allclose(
        _losses(tmp_path / "two.jsonl"), _losses(tmp_path / "one.jsonl"), rtol=1e-6
    )
    # The 2-process checkpoint restores in this single process (2 x 4 emulated).
    two_state, one_state = _final_state(tmp_path / "c2", 10), _final_state(tmp_path / "c1", 10)
    worst = 0.0
    for a, b in zip(jax.tree.leaves(two_state), jax.tree.leaves(one_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        if a.dtype.kind == "f":
            worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)))
    loss_gap = np.max(
        np.abs(np.subtract(_losses(tmp_path / "two.jsonl"), _losses(tmp_path / "one.jsonl")))
    )
    print(f"2 processes vs 1: max |loss diff| {loss_gap:.2e}, max |state diff| {worst:.2e}")


def test_sigkill_one_process_then_resume(tmp_path):
    steps, every = 60, 10
    args = [*TRAIN, "--steps", str(steps), "--ckpt-every", str(every)]
    ckpt = tmp_path / "ckpt"
    # The uninterrupted reference: the same two processes, never killed.
    ref = _zpp(["launch", "--nodes", "2", "--", *args, "--ckpt-dir", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr[-3000:]

    def start(resume):
        port = free_port()
        extra = ["--resume"] if resume else []
        return [
            subprocess.Popen(
                [sys.executable, "-m", "zpp_jax", *args, "--ckpt-dir", str(ckpt), *extra],
                env=process_env(
                    i, 2, 4, f"127.0.0.1:{port}", heartbeat_timeout=10, base=_single_env()
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]

    procs = start(resume=False)
    try:
        deadline = time.monotonic() + 300
        while not (ckpt / str(2 * every)).exists():  # mid-training, after a checkpoint
            assert time.monotonic() < deadline, "no checkpoint appeared"
            assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=90)
        survivor_s = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"survivor exited {survivor_s:.1f} s after the SIGKILL, status {procs[0].returncode}")
    assert procs[0].returncode != 0
    assert survivor_s < 60
    # Whichever notices first: the failed collective (our message, exit 3) or
    # the coordination service's lost heartbeat (JAX's message, abort).
    assert (
        "another process of this job has probably died" in err
        or "This most likely indicates that another task died" in err
    ), err[-3000:]

    last = Checkpointer(ckpt).latest_step()
    assert last is not None and every <= last < steps
    procs = start(resume=True)
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    _assert_states_equal(_final_state(ckpt, steps), _final_state(tmp_path / "ref", steps))


def test_launch_reports_the_first_failure_and_stops_the_rest(capfd):
    from zpp_jax.launch import launch

    script = (
        "import os, sys, time\n"
        "i = int(os.environ['ZPP_PROCESS_ID'])\n"
        "assert os.environ['ZPP_NUM_PROCESSES'] == '3'\n"
        "assert os.environ['ZPP_LOCAL_CPU_DEVICES'] == '2'\n"
        "time.sleep(600) if i == 0 else sys.exit(0 if i == 1 else 7)\n"
    )
    start = time.monotonic()
    assert launch(["python", "-c", script], nodes=3, local=2, grace=1.0) == 7
    assert time.monotonic() - start < 30  # the sleeper was stopped after the grace period
    err = capfd.readouterr().err
    assert "process 2 exited with status 7" in err and "stopping them" in err


def test_launch_rejects_bad_arguments():
    from zpp_jax.launch import launch

    with pytest.raises(ValueError, match="nodes"):
        launch(["train"], nodes=0)
    with pytest.raises(ValueError, match="nothing to launch"):
        launch([], nodes=2)
    with pytest.raises(ValueError, match="cannot launch itself"):
        launch(["launch", "--", "train"], nodes=2)


def test_slurm_job_counts_as_multi_process(monkeypatch):
    for k in ("ZPP_NUM_PROCESSES", "ZPP_PROCESS_ID", "ZPP_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert DistributedConfig.from_env().is_multi_process
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not DistributedConfig.from_env().is_multi_process
