"""Several processes as several nodes (jax.distributed, gloo over TCP), and
losing one of them. Each process is a real `python -m zpp_jax` subprocess."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import warnings

import corpora
import jax
import numpy as np
import pytest

from zpp_jax.checkpoint import Checkpointer
from zpp_jax.distributed import DistributedConfig
from zpp_jax.launch import free_port, process_env
from zpp_jax.recipes import RunConfig, make_trainer
from zpp_jax.train import Trainer

# No clipping (a bound far above the gradient norm): then only the reported
# loss and norm are all-reduced, and the training trajectory depends on no
# sum whose order differs between one process and two (the gradient
# reduction is exchanges of codes and fixed-order sums).
TRAIN = ["train", "--quiet", "--error-feedback", "--eval-every", "0", "--clip", "1e9"]
TRAIN += ["--seq", "16", "--batch", "8"]
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


def _run_config(steps):
    from zpp_jax.config import ZeroPPConfig

    return RunConfig(zero=ZeroPPConfig(**ZERO), steps=steps, seq_len=16, batch=8, vocab_size=300)


def _final_state(ckpt_dir, steps):
    trainer = make_trainer(_run_config(steps))
    state, meta = Checkpointer(ckpt_dir).restore(trainer.abstract_state())
    assert not meta["residuals_reset"] and Trainer.steps_done(state) == steps
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


def _start_pair(args, env_base):
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "zpp_jax", *args],
            env=process_env(i, 2, 4, f"127.0.0.1:{port}", heartbeat_timeout=10, base=env_base),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_two_processes_stopped_by_sigterm_resume_and_equal_one(tmp_path):
    """One process on 2 x 4 devices (qwZ, hpZ, qgZ and error feedback)
    trains on a text of its own with a BPE trained on it (`--tokenizer
    bpe:300`). Two processes, `zpp launch --nodes 2 -- train`, train the
    same run, each reading only its half of every batch, and the launcher
    gets SIGTERM (a cluster taking the machines back) once step 2 is
    recorded: both processes finish the same step, save one checkpoint of
    it and exit 143, which the launcher returns. `--resume` under
    `zpp launch` (the BPE the checkpoints saved, reused) ends the run as
    the one process ended it: each step recorded once, the same losses up
    to fp32 round-off (so the same global batches), and the same final
    state bit for bit. What a survivor does when its peer is killed:
    `test_the_survivor_of_a_sigkilled_peer_exits_3`."""
    steps = 8
    text = corpora.write(tmp_path / "text")
    args = [*TRAIN, "--data", str(text), "--tokenizer", "bpe:300"]
    args += ["--steps", str(steps), "--ckpt-every", "1000"]
    one = [*args, "--metrics", str(tmp_path / "one.jsonl"), "--ckpt-dir", str(tmp_path / "c1")]
    single = _zpp(one)
    assert single.returncode == 0, single.stderr[-3000:]

    ckpt, metrics = tmp_path / "c2", tmp_path / "two.jsonl"
    two = [
        "launch",
        "--nodes",
        "2",
        "--",
        *args,
        "--ckpt-dir",
        str(ckpt),
        "--metrics",
        str(metrics),
    ]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "zpp_jax", *two],
        env=_single_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    stopped_at = len(metrics.read_text().splitlines())
    assert launcher.returncode == 143 and stopped_at < steps, err[-3000:]
    assert "zpp launch: SIGTERM: passed to the processes" in err
    assert err.count(f"stopped by SIGTERM after step {stopped_at}: checkpoint {stopped_at}") == 1
    assert "zpp launch: process 0 exited with status 143" in err
    assert "zpp launch: process 1 exited with status 143" in err
    assert Checkpointer.steps_in(ckpt) == [stopped_at]

    resumed = _zpp([*two, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for i, rows in enumerate(("0-3", "4-7")):
        assert f"process {i} of 2 reads rows {rows} of each batch of 8" in resumed.stderr
    assert (ckpt / "tokenizer.json").read_text() == (tmp_path / "c1" / "tokenizer.json").read_text()

    # The reported loss is a mean over 8 devices, which gloo sums in another
    # order: equal up to 8 units of fp32 round-off (u = 2^-24). Everything
    # the training trajectory depends on is summed in a fixed order: the
    # 2-process checkpoint, restored here, is bit for bit the 1-process one.
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(
        range(1, steps + 1)
    )
    u = 2.0**-24
    loss_one = np.array(_losses(tmp_path / "one.jsonl"))
    loss_two = np.array(_losses(metrics))
    assert len(loss_one) == len(loss_two) == steps
    assert np.all(np.abs(loss_two - loss_one) <= 8 * u * loss_one)
    _assert_states_equal(_final_state(ckpt, steps), _final_state(tmp_path / "c1", steps))


def test_launch_reports_the_first_failure_and_stops_the_rest(capfd, tmp_path):
    from zpp_jax.launch import launch

    script = (
        "import os, sys, time\n"
        "i = int(os.environ['ZPP_PROCESS_ID'])\n"
        "assert os.environ['ZPP_NUM_PROCESSES'] == '3'\n"
        "assert os.environ['ZPP_LOCAL_CPU_DEVICES'] == '2'\n"
        "if i == 0:\n"
        "    time.sleep(600)\n"
        f"    open({str(tmp_path / 'woke')!r}, 'w').close()\n"
        "sys.exit(0 if i == 1 else 7)\n"
    )
    assert launch(["python", "-c", script], nodes=3, local=2, grace=1.0) == 7
    err = capfd.readouterr().err
    assert "process 2 exited with status 7" in err and "stopping them" in err
    lines = err.splitlines()
    assert "zpp launch: process 0 stopped by the launcher" in lines
    assert "zpp launch: process 1 exited with status 0" in lines
    assert "zpp launch: process 2 exited with status 7" in lines
    # The sleeper was stopped, not left to finish its sleep.
    assert not (tmp_path / "woke").exists()


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


# A job that only does collectives: each process records its pid, then sums
# over all devices until a peer is lost, which it handles as `zpp` does.
PEER_SCRIPT = """
import functools, os, pathlib, sys, time
from zpp_jax.cli import _lost_peer
from zpp_jax.distributed import initialize, node_mesh
initialize(on_lost_peer=functools.partial(_lost_peer, "job"))
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = node_mesh()
x = jax.make_array_from_callback(
    (jax.device_count(),), NamedSharding(mesh, P(("node", "local"))),
    lambda i: np.ones(1, np.float32))
total = jax.jit(jnp.sum)
total(x).block_until_ready()
tmp = pathlib.Path(sys.argv[1], f"pid{jax.process_index()}.tmp")
tmp.write_text(str(os.getpid()))
tmp.rename(tmp.with_suffix(""))
try:
    while True:
        total(x).block_until_ready()
        time.sleep(0.02)
except Exception as e:
    _lost_peer("job", type(e).__name__)
"""


def _launch_peers(tmp_path):
    script = tmp_path / "peers.py"
    script.write_text(PEER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZPP_")}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "zpp_jax", "launch", "--nodes", "2", "--local", "1"]
        + ["--", "python", str(script), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = [tmp_path / f"pid{i}" for i in range(2)]
    deadline = time.monotonic() + 120  # a hang guard for start-up
    try:
        while not all(p.exists() for p in pids):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
    except BaseException:
        launcher.kill()  # its workers die with it
        raise
    return launcher, [int(p.read_text()) for p in pids]


def _gone(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_the_survivor_of_a_sigkilled_peer_exits_3(tmp_path, victim):
    """Whichever process dies (0 also hosts the coordination service), the
    other stops within 15 s with exit status 3 and the clear message, and
    the launcher reports both statuses on lines of their own."""
    launcher, pids = _launch_peers(tmp_path)
    try:
        os.kill(pids[victim], signal.SIGKILL)
        _, err = launcher.communicate(timeout=15)
    finally:
        launcher.kill()
    survivor = 1 - victim
    assert f"zpp launch: process {survivor} exited with status 3" in err.splitlines(), err
    assert f"zpp launch: process {victim} was killed by SIGKILL" in err.splitlines(), err
    assert "another process of this job has probably died" in err
    # The first failure it saw: both may show up at the same poll.
    assert launcher.returncode in (3, 128 + signal.SIGKILL)


@pytest.mark.slow
def test_no_worker_outlives_a_sigkilled_launcher(tmp_path):
    launcher, pids = _launch_peers(tmp_path)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 15
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if not _gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived the launcher by 15 s"


@pytest.mark.slow
def test_a_job_that_cannot_start_says_why_in_one_line():
    """A coordinator port in use, a bad flag that every worker refuses, a
    coordinator that never answers, an address that is not one: each ends
    with one line and status 2, within its timeout, without a C++ abort."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _zpp(["launch", "--nodes", "2", "--port", str(port), "--", "train", "--steps", "1"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"zpp launch: error: --port {port}: Address already in use on 127.0.0.1; choose another "
        "port, or leave --port out for a free one"
    ]
    r = _zpp(["launch", "--nodes", "2", "--", "train", "--steps", "0"])
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if ": error: " in line]
    assert errors == [
        "zpp train: error: argument --steps: must be an int from 1 to 2,147,483,647 (the "
        "optimizer counts steps in int32), got 0"
    ]
    assert "process 1 exited with status 2" in r.stderr and "Check failure" not in r.stderr
    for address, message in (
        (f"127.0.0.1:{free_port()}", "did not answer within 3 s ($ZPP_INIT_TIMEOUT)"),
        ("nowhere", "the coordinator address 'nowhere' is not host:port"),
    ):
        env = process_env(1, 2, 4, address, base=_single_env(), init_timeout=3)
        r = _zpp(["train", "--steps", "1", "--quiet"], env=env)
        assert r.returncode == 2
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_a_cpu_job_on_a_jaxlib_that_hangs_on_cached_programs_compiles_without_the_cache(
    monkeypatch,
):
    """Where the jaxlib hangs a multi-process CPU job on programs loaded from
    the persistent compilation cache (0.12.1), `initialize` turns the cache
    off for the job and says why; elsewhere it leaves the cache alone."""
    from zpp_jax import _compat, distributed

    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    hangs = _compat.cached_programs_hang_cpu_jobs()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            distributed._keep_cpu_jobs_off_the_cache()
        assert len(caught) == hangs and jax.config.jax_enable_compilation_cache != hangs
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    monkeypatch.setattr(_compat, "cached_programs_hang_cpu_jobs", lambda: True)
    try:
        with pytest.warns(UserWarning, match="hangs a multi-process CPU job .* without it"):
            distributed._keep_cpu_jobs_off_the_cache()
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
