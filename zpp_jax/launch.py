"""`zpp launch`: N local processes as N nodes of one `jax.distributed` job.

For development, tests and benchmarks on one machine: every process gets
`local` CPU devices and gloo collectives over TCP, and is told its identity
through the `ZPP_*` variables `zpp_jax.distributed.initialize` reads. On real
GPU hosts, start one process per host with a cluster launcher instead (see the
README).

Failure handling: a process that never joins makes the others give up after
`init_timeout` seconds; when one process exits with an error or is killed, the
others are left `grace` seconds to notice on their own (their next collective
fails, or the coordination service reports the lost heartbeat), then stopped.
The launcher prints every process's exit status on a line of its own and
returns the first failing process's. Its processes die with it: SIGINT and
SIGTERM are passed on to them, and on Linux each process is also killed when
the launcher dies for any reason, SIGKILL included (the parent-death signal).

A signal passed on stops `zpp train` after its current step, with a
checkpoint (`zpp_jax.preemption`): the launcher waits for that and returns
the processes' status, 128 + the signal's number (143 for SIGTERM).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from types import MappingProxyType

from zpp_jax.distributed import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_LOCAL_CPU_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    MAX_CPU_DEVICES,
    port_taken,
)
from zpp_jax.errors import Number, UsageError, count

# The ranges of `launch`'s arguments, which the `zpp launch` flags take; read-only.
RANGES = MappingProxyType(
    {
        "nodes": count(1, 1024, "processes on this machine"),
        "local": count(1, MAX_CPU_DEVICES, "CPU devices a process: XLA:CPU's limit"),
        "port": count(1, 65535, "a TCP port"),
        "heartbeat_timeout": count(why="seconds"),
        "init_timeout": count(why="seconds"),
        "grace": Number(float, 0, why="seconds"),
    }
)


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise UsageError if a process listens on `port` already (the
    coordinator could not start there)."""
    taken = port_taken(port, host)
    if taken:
        raise UsageError(
            f"--port {port}: {taken} on {host}; choose another port, or leave --port out for a "
            "free one"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for the coordinator)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(
    process_id: int,
    nodes: int,
    local: int,
    coordinator: str,
    heartbeat_timeout: int | None = None,
    base: dict[str, str] | None = None,
    init_timeout: int | None = None,
) -> dict[str, str]:
    """The environment of process `process_id` of an N-node local job."""
    env = dict(os.environ if base is None else base)
    # A device count forced through these would override the per-process one.
    env.pop("JAX_NUM_CPU_DEVICES", None)
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env.update(
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(nodes),
            ENV_PROCESS_ID: str(process_id),
            ENV_LOCAL_CPU_DEVICES: str(local),
        }
    )
    if heartbeat_timeout is not None:
        env[ENV_HEARTBEAT_TIMEOUT] = str(heartbeat_timeout)
    if init_timeout is not None:
        env[ENV_INIT_TIMEOUT] = str(init_timeout)
    return env


def launch(
    argv: list[str],
    nodes: int,
    local: int = 4,
    port: int | None = None,
    heartbeat_timeout: int = 10,
    grace: float = 60.0,
    init_timeout: int = 30,
) -> int:
    """Run ``zpp <argv>`` (or, for ``argv = ["python", ...]``, that Python
    command) as `nodes` processes; returns the exit
    status: 0 when all succeed, else the first failure's (128 + signal number
    for a process killed by a signal)."""
    given = dict(
        nodes=nodes,
        local=local,
        heartbeat_timeout=heartbeat_timeout,
        grace=grace,
        init_timeout=init_timeout,
    )
    if port is not None:
        given["port"] = port
    for name, value in given.items():
        RANGES[name].check(f"--{name.replace('_', '-')}", value)
    if port is not None:
        check_port_free(port)
    if not argv:
        raise UsageError("nothing to launch: give a zpp subcommand after --, e.g. -- train")
    if argv[0] == "launch":
        raise UsageError("zpp launch cannot launch itself")
    coordinator = f"127.0.0.1:{port or free_port()}"
    # `-- python script.py ...` runs a script; anything else is a zpp subcommand.
    cmd = (
        [sys.executable, *argv[1:]]
        if argv[0] == "python"
        else [sys.executable, "-m", "zpp_jax", *argv]
    )
    procs = [
        subprocess.Popen(
            cmd,
            env=process_env(
                i, nodes, local, coordinator, heartbeat_timeout, init_timeout=init_timeout
            ),
            preexec_fn=_die_with_parent(os.getpid()),
        )
        for i in range(nodes)
    ]

    forwarded: list[int] = []

    def forward(signum, frame):
        if not forwarded:
            _say(
                f"{signal.Signals(signum).name}: passed to the processes; waiting for them to "
                "finish their step, save and stop"
            )
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    stopped: list[int] = []
    try:
        return _wait(procs, grace, stopped, forwarded)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for i, p in enumerate(procs):
            if p.poll() is None:
                stopped.append(i)
                p.kill()
                p.wait()
        for i, p in enumerate(procs):
            how = "stopped by the launcher" if i in stopped else _describe(p.returncode)
            _say(f"process {i} {how}")


def _die_with_parent(parent: int):
    """A `preexec_fn` that has the kernel SIGKILL the child when the launcher
    dies (Linux's PR_SET_PDEATHSIG), and exits at once if it already has."""
    if not sys.platform.startswith("linux"):
        return None

    def arrange() -> None:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return arrange


def _say(message: str) -> None:
    # A line of its own: a worker's progress bar may have left the cursor
    # in the middle of one.
    print(
        f"\nzpp launch: {message}" if sys.stderr.isatty() else f"zpp launch: {message}",
        file=sys.stderr,
        flush=True,
    )


def _wait(
    procs: list[subprocess.Popen], grace: float, stopped: list[int], forwarded: list[int]
) -> int:
    """Wait for every process; once one fails, the others get `grace`
    seconds. A process that stops on a signal the launcher passed on
    (`forwarded`) has not failed: its status is returned all the same."""
    failed_at = None
    status = 0
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0) and failed_at is None:
                failed_at, status = time.monotonic(), _exit_status(code)
                if not forwarded:
                    _say(
                        f"process {i} {_describe(code)}; waiting up to {grace:.0f} s for the "
                        "others to stop"
                    )
        if all(c is not None for c in codes):
            return status
        if failed_at is not None and time.monotonic() - failed_at > grace:
            alive = [i for i, c in enumerate(codes) if c is None]
            _say(f"processes {alive} still running {grace:.0f} s after a failure: stopping them")
            return status
        time.sleep(0.2)


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
