"""Start JAX on several hosts: one process per node, its devices the `local` axis.

`initialize()` wraps `jax.distributed.initialize` so that the same script runs
under a real cluster launcher (SLURM and the other environments JAX detects),
under `zpp launch` (which sets the `ZPP_*` variables below for N local
processes), or with explicit arguments; `node_mesh()` then builds the
node x local mesh with node = process.

Environment variables read when an argument is not given:

- `ZPP_COORDINATOR_ADDRESS` (or JAX's `JAX_COORDINATOR_ADDRESS`): host:port of
  process 0's coordination service;
- `ZPP_NUM_PROCESSES`, `ZPP_PROCESS_ID`: the process count and this process's id;
- `ZPP_LOCAL_CPU_DEVICES`: emulate that many CPU devices in this process
  (development and tests; real GPU hosts leave it unset);
- `ZPP_HEARTBEAT_TIMEOUT`, `ZPP_INIT_TIMEOUT`: the timeouts below, in seconds.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from zpp_jax.errors import UsageError

if TYPE_CHECKING:
    from jax.sharding import Mesh

# JAX is imported by the functions that use it: `DistributedConfig` alone
# (how `zpp` tells whether it runs in a multi-process job) must not cost it.

ENV_COORDINATOR = "ZPP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZPP_NUM_PROCESSES"
ENV_PROCESS_ID = "ZPP_PROCESS_ID"
ENV_LOCAL_CPU_DEVICES = "ZPP_LOCAL_CPU_DEVICES"
ENV_HEARTBEAT_TIMEOUT = "ZPP_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "ZPP_INIT_TIMEOUT"

# XLA:CPU runs the devices of one process on a pool of 256 threads: a
# collective over more devices waits for threads that never come, and the
# process aborts after 40 s.
MAX_CPU_DEVICES = 256


def coordinator(address: str) -> tuple[str, int]:
    """(host, port) of a coordinator address ``host:port`` (``[::1]:port``
    for IPv6).

    Raises:
      UsageError: `address` is not host:port with a port in 1..65535.
    """
    host, _, port = str(address).rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(
            f"the coordinator address {address!r} is not host:port (e.g. 10.0.0.1:1234, a port "
            f"from 1 to 65535); set ${ENV_COORDINATOR}"
        )
    return host, int(port)


def port_taken(port: int, host: str = "127.0.0.1") -> str | None:
    """Why `port` on `host` cannot be listened on (what the operating system
    said: another process holds it), or None when it can."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return str(e.strerror or e)
    return None


def check_cpu_devices(count: int, what: str) -> None:
    """Raise UsageError unless `count` emulated CPU devices (`what` says
    which flags made it) fit in one process."""
    if count > MAX_CPU_DEVICES:
        raise UsageError(
            f"{what} = {count:,} CPU devices in one process; XLA:CPU runs collectives over at "
            f"most {MAX_CPU_DEVICES}: use fewer, or several processes (zpp launch)"
        )


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in the job.

    `coordinator_address=None` with `num_processes=None` lets JAX detect the
    cluster (SLURM, Open MPI, Kubernetes, Cloud TPU). Timeouts are seconds:
    `initialization_timeout` bounds the wait for all processes to join,
    `heartbeat_timeout` is how long a silent process (killed, hung, cut off)
    is tolerated before the others are told it is gone, `shutdown_timeout`
    bounds the barrier at exit.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_cpu_devices: int | None = None
    initialization_timeout: int = 300
    heartbeat_timeout: int = 100
    shutdown_timeout: int = 300
    cluster_detection_method: str | None = None

    def __post_init__(self) -> None:
        for name in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise UsageError(f"{name} must be a positive number of seconds, got {v!r}")
        n, i = self.num_processes, self.process_id
        if n is not None and (not isinstance(n, int) or n <= 0):
            raise UsageError(f"num_processes must be a positive int, got {n!r}")
        if i is not None and (not isinstance(i, int) or i < 0 or (n is not None and i >= n)):
            raise UsageError(f"process_id must be an int in [0, num_processes), got {i!r}")
        if (n is None) != (i is None):
            raise UsageError("give num_processes and process_id together (or neither)")
        if n is not None and n > 1 and not self.coordinator_address:
            raise UsageError(
                f"{n} processes need a coordinator_address (host:port of process 0), "
                f"e.g. via ${ENV_COORDINATOR}"
            )
        if self.coordinator_address:
            coordinator(self.coordinator_address)
        d = self.local_cpu_devices
        if d is not None and (not isinstance(d, int) or d <= 0):
            raise UsageError(f"local_cpu_devices must be a positive int, got {d!r}")
        if d is not None:
            check_cpu_devices(d, "local_cpu_devices")

    @classmethod
    def from_env(cls, **overrides) -> DistributedConfig:
        """Fields from the `ZPP_*` variables (and `JAX_COORDINATOR_ADDRESS`);
        `overrides` that are not None win."""
        env = os.environ

        def as_int(name):
            value = env.get(name)
            if value is None or value == "":
                return None
            try:
                return int(value)
            except ValueError:
                raise UsageError(f"${name} must be an integer, got {value!r}") from None

        fields = dict(
            coordinator_address=env.get(ENV_COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS"),
            num_processes=as_int(ENV_NUM_PROCESSES),
            process_id=as_int(ENV_PROCESS_ID),
            local_cpu_devices=as_int(ENV_LOCAL_CPU_DEVICES),
            heartbeat_timeout=as_int(ENV_HEARTBEAT_TIMEOUT),
            initialization_timeout=as_int(ENV_INIT_TIMEOUT),
        )
        fields = {k: v for k, v in fields.items() if v is not None}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    @property
    def is_multi_process(self) -> bool:
        """True for several processes, given or left to JAX to detect."""
        if self.num_processes is not None:
            return self.num_processes > 1
        return self.cluster_detection_method is not None or detected_launcher() is not None


# Variables by which the launchers JAX auto-detects announce a multi-process job.
_LAUNCHERS = {"SLURM": "SLURM_NTASKS", "Open MPI": "OMPI_COMM_WORLD_SIZE"}


def detected_launcher() -> str | None:
    """The cluster launcher that started this process with several tasks
    (SLURM, Open MPI), or None."""
    for name, var in _LAUNCHERS.items():
        try:
            if int(os.environ.get(var, "1")) > 1:
                return name
        except ValueError:
            pass
    return None


def initialize(
    config: DistributedConfig | None = None,
    on_lost_peer: Callable[[str], None] | None = None,
) -> DistributedConfig:
    """Join the job described by `config` (default: `DistributedConfig.from_env()`).

    Must run before anything touches a JAX device. A single-process config
    only applies `local_cpu_devices`. With several processes the CPU
    collectives go over gloo (TCP); a process that dies is reported to the
    others after `heartbeat_timeout` seconds, and their next collective fails
    instead of waiting forever.

    `on_lost_peer(message)` is called, on a background thread, when the
    coordination service counts a process of the job as gone, or cannot be
    reached; it should end this process (``os._exit``). Without it, JAX
    aborts the process with a fatal log and a C++ stack trace. Returns the
    config used.
    """
    import jax

    config = DistributedConfig.from_env() if config is None else config
    if config.local_cpu_devices is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", config.local_cpu_devices)
    if not config.is_multi_process:
        return config
    if config.local_cpu_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if on_lost_peer is not None:
        # The service then keeps serving the others when a process is lost,
        # instead of making every agent abort; `_watch` tells them instead.
        jax.config.update("jax_enable_recoverability", True)
    _check_coordinator(config)
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        cluster_detection_method=config.cluster_detection_method,
        initialization_timeout=config.initialization_timeout,
        heartbeat_timeout_seconds=config.heartbeat_timeout,
        shutdown_timeout_seconds=config.shutdown_timeout,
    )
    if config.local_cpu_devices is not None:
        _keep_cpu_jobs_off_the_cache()
    if on_lost_peer is not None:
        _watching.set()
        threading.Thread(
            target=_watch, args=(jax.process_count(), on_lost_peer), daemon=True
        ).start()
    return config


def _keep_cpu_jobs_off_the_cache() -> None:
    """Turn off the persistent compilation cache for this multi-process CPU
    job where the jaxlib hangs such a job on a cached program, with a warning
    that says why: each program is then compiled, as without a cache."""
    import warnings

    import jax
    import jaxlib

    from zpp_jax._compat import cached_programs_hang_cpu_jobs

    cache_on = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    if cached_programs_hang_cpu_jobs() and cache_on:
        jax.config.update("jax_enable_compilation_cache", False)
        warnings.warn(
            f"jaxlib {jaxlib.__version__} hangs a multi-process CPU job on programs loaded "
            "from the persistent compilation cache: this job compiles without it",
            stacklevel=3,
        )


def _check_coordinator(config: DistributedConfig) -> None:
    """Before JAX's client connects (and aborts the process, with a C++
    stack, when it cannot): process 0's coordinator port is free, and the
    other processes reach it within the initialization timeout.

    Raises:
      UsageError: naming the address and the timeout.
    """
    if not config.coordinator_address or config.process_id is None:
        return  # a cluster JAX detects says where the coordinator is
    host, port = coordinator(config.coordinator_address)
    if config.process_id == 0:
        taken = port_taken(port, "")
        if taken:
            raise UsageError(
                f"process 0 cannot serve as the coordinator on port {port}: {taken}; "
                f"choose another port in ${ENV_COORDINATOR}"
            )
        return
    deadline = time.monotonic() + config.initialization_timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise UsageError(
                    f"the coordinator at {config.coordinator_address} did not answer within "
                    f"{config.initialization_timeout} s (${ENV_INIT_TIMEOUT}): start process 0 "
                    f"first, or check ${ENV_COORDINATOR}"
                ) from None
            time.sleep(0.2)


_watching = threading.Event()  # `initialize` started the watchdog
_finished = threading.Event()  # `finish` stopped it


def _watch(count: int, on_lost_peer: Callable[[str], None], interval: float = 0.25) -> None:
    """Ask the coordination service every `interval` seconds which processes
    are alive; call `on_lost_peer` once one is not (the service counts a
    process dead `heartbeat_timeout` seconds after its last heartbeat, or at
    once when it disconnects), or once the service itself cannot be reached.
    Stops at `finish`."""
    from zpp_jax._compat import coordination_client

    client = coordination_client()
    everyone = list(range(count))
    while not _finished.wait(interval):
        try:
            live = set(client.get_live_nodes(everyone))
            reason = None
            lost = sorted(set(everyone) - live)
            if lost:
                reason = f"process {', '.join(map(str, lost))} stopped sending heartbeats"
        except Exception as e:  # noqa: BLE001 - the service is gone, whatever the error
            reason = f"lost the coordination service ({type(e).__name__})"
        if reason and not _finished.is_set():
            on_lost_peer(reason)
            return


def finish(timeout: int = 300) -> None:
    """Wait until every process of the job gets here, then stop watching for
    lost peers: a process that ends its work normally and exits is then not
    taken for a lost one. Call it last, in every process (a no-op in one
    process or without `initialize(on_lost_peer=...)`, where JAX's own
    shutdown barrier does this).

    Raises:
      jax.errors.JaxRuntimeError: a process did not arrive within `timeout`
        seconds (it died, or hangs).
    """
    import jax

    from zpp_jax._compat import coordination_client

    client = coordination_client()
    if client is None or not _watching.is_set() or _finished.is_set():
        return
    client.wait_at_barrier("zpp_finish", timeout * 1000)
    _finished.set()
    # A second barrier before anyone disconnects: a process whose main
    # thread is still between the first barrier and the line above (a
    # loaded machine) would otherwise see the first to leave as a lost peer
    # and fail a job that has finished.
    client.wait_at_barrier("zpp_finish_watching", timeout * 1000)
    # The service lives in process 0 and, with recoverable tasks, no longer
    # holds it back at exit: the others disconnect first, and process 0
    # waits for that before it leaves.
    everyone = list(range(jax.process_count()))
    if jax.process_index() != 0:
        jax.distributed.shutdown()
        return
    deadline = time.monotonic() + timeout
    while set(client.get_live_nodes(everyone)) - {0} and time.monotonic() < deadline:
        time.sleep(0.05)
    jax.distributed.shutdown()


def node_mesh() -> Mesh:
    """The (node, local) mesh with one node per process and the process's own
    devices on `local`; in one process, 1 x all devices."""
    import jax

    from zpp_jax.mesh import make_mesh

    return make_mesh(jax.process_count(), jax.local_device_count())


def max_over_processes(value: int) -> int:
    """The largest of every process's `value` (an int32), known to all:
    how processes agree on a flag, such as a stop request, at the same point
    of their programs. Every process must call it. Costs one all-gather of
    4 bytes per process; in a single process, nothing."""
    import jax

    if jax.process_count() == 1:
        return int(value)
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(value))))
