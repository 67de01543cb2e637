"""Two nodes on one machine, joined by a link of a chosen bandwidth.

    sudo python benchmarks/cluster/run.py                       # 1 Gbit/s
    sudo python benchmarks/cluster/run.py --rates 10gbit 1gbit 200mbit

Builds two network namespaces (`zppbench0`, `zppbench1`) joined by a veth pair
whose both ends are shaped with `tc ... tbf` to the rate, maps this machine's
hostname to each namespace's own address in `/etc/netns/<ns>/hosts` (gloo
binds to the hostname's address), and runs `node.py` in each namespace: two
`jax.distributed` processes with 4 CPU devices each, a 2 x 4 (node, local)
mesh. For every rate it prints the median step time of ZeRO-3, ZeRO++ and
plain `jax.jit`, the bytes that crossed the link per step, and the ratios.
The nodes keep large malloc blocks between steps (`MALLOC_ENV`, every method
alike; `--system-malloc` turns it off). Everything it created is removed on
exit, also on failure or Ctrl-C. Needs root (network namespaces and tc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

NAMESPACES = ("zppbench0", "zppbench1")
LINKS = ("zppveth0", "zppveth1")
ADDRESSES = ("10.213.7.1", "10.213.7.2")
PORT = 47611
HERE = pathlib.Path(__file__).resolve().parent


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _in_ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh("ip", "netns", "exec", ns, *cmd, check=check)


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for suffix, scale in units.items():
        if rate.lower().endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"rate {rate!r}: write it like 10gbit, 1gbit or 200mbit")


def cleanup() -> None:
    """Remove every namespace, link and hosts file this script creates (idempotent)."""
    for ns in NAMESPACES:
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    _sh("ip", "link", "del", LINKS[0], check=False)


def setup() -> None:
    cleanup()
    host = socket.gethostname()
    for ns in NAMESPACES:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", LINKS[0], "type", "veth", "peer", "name", LINKS[1])
    for ns, link, addr in zip(NAMESPACES, LINKS, ADDRESSES, strict=True):
        _sh("ip", "link", "set", link, "netns", ns)
        _in_ns(ns, "ip", "addr", "add", f"{addr}/30", "dev", link)
        _in_ns(ns, "ip", "link", "set", link, "up")
        _in_ns(ns, "ip", "link", "set", "lo", "up")
        hosts = pathlib.Path(f"/etc/netns/{ns}/hosts")
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f"127.0.0.1 localhost\n{addr} {host}\n")


def shape(rate: str) -> None:
    """tbf on both veth ends: `rate` each way, a burst of 10 ms worth of bytes."""
    burst = max(int(_rate_bits(rate) / 8 / 100), 64 * 1024)
    for ns, link in zip(NAMESPACES, LINKS, strict=True):
        _in_ns(
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            link,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            str(burst),
            "latency",
            "100ms",
        )


# XLA:CPU allocates each step's buffers with malloc, and with glibc's default
# thresholds large freed blocks go back to the system (munmap, heap trimming):
# every step page-faults and zeroes its buffers again. In a perf profile of
# the nodes that was about 8% of all CPU samples (ZeRO++'s system time went
# from 0.19 to 0.12 s per step without it). Serving large blocks from the
# heap, growing it in large steps and keeping it (as tcmalloc or jemalloc
# would) applies to every method alike; --system-malloc turns it off.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 32),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
    "MALLOC_TOP_PAD_": str(1 << 29),
}


def node_env(process_id: int, system_malloc: bool = False) -> dict[str, str]:
    """The environment of node `process_id`: this one without XLA_/JAX_
    settings (each node sets its own devices), the coordinator of the two
    processes, and MALLOC_ENV unless `system_malloc` (a MALLOC_ variable set
    by the caller wins)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    if not system_malloc:
        env = {**MALLOC_ENV, **env}
    return dict(
        env,
        ZPP_COORDINATOR_ADDRESS=f"{ADDRESSES[0]}:{PORT}",
        ZPP_NUM_PROCESSES="2",
        ZPP_PROCESS_ID=str(process_id),
        ZPP_LOCAL_CPU_DEVICES="4",
        TF_CPP_MIN_LOG_LEVEL="2",
    )


def run_nodes(node_args: list[str], timeout: float, system_malloc: bool = False) -> list[dict]:
    """Run node.py in both namespaces; the records printed by process 0."""
    procs = []
    try:
        for i, (ns, link) in enumerate(zip(NAMESPACES, LINKS, strict=True)):
            env = node_env(i, system_malloc)
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                str(HERE / "node.py"),
                "--link",
                link,
                *node_args,
            ]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        deadline = time.monotonic() + timeout
        outs = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the nodes did not finish within {timeout:.0f} s") from None
            if p.returncode != 0:
                raise RuntimeError(f"a node exited with {p.returncode}:\n{err[-3000:]}")
            outs.append(out)
        return [json.loads(line[7:]) for line in outs[0].splitlines() if line.startswith("RESULT ")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| link | method | median step | link bytes/step (each way) | ZeRO++ speedup |",
        "|---|---|---|---|---|",
    ]
    for rate, recs in results.items():
        by = {r["method"]: r for r in recs}
        zpp = by.get("zeropp")
        for r in recs:
            speed = f"{r['median_s'] / zpp['median_s']:.2f}x" if zpp else ""
            if r["method"] == "zeropp":
                speed = "1.00x"
            lines.append(
                f"| {rate} | {r['method']} | {r['median_s']:.3f} s | "
                f"{(r['link_tx_bytes'] + r['link_rx_bytes']) / 2 / 1e6:.1f} MB | {speed} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Two-node ZeRO++ benchmark over a shaped link.")
    p.add_argument(
        "--rates",
        nargs="+",
        default=["1gbit"],
        help="link rates to run in turn (tc syntax: 10gbit, 1gbit, 200mbit)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per rate")
    p.add_argument("--json", default=None, help="also write all records to this file")
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="keep glibc's default mmap and trim thresholds in the nodes (see MALLOC_ENV)",
    )
    args, node_args = p.parse_known_args(argv)
    for rate in args.rates:
        _rate_bits(rate)
    if os.geteuid() != 0:
        sys.exit(
            "benchmarks/cluster/run.py needs root (it creates network namespaces and "
            "shapes them with tc): run it with sudo"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.exit(f"`{tool}` not found: install iproute2")

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    results = {}
    try:
        setup()
        for rate in args.rates:
            shape(rate)
            print(f"== {rate}", flush=True)
            recs = run_nodes([*node_args, "--tag", rate], args.timeout, args.system_malloc)
            for r in recs:
                print(
                    f"  {r['method']:7s} median {r['median_s']:.3f} s  "
                    f"times {[round(t, 3) for t in r['times_s']]}  link "
                    f"{r['link_tx_bytes'] / 1e6:.1f}/{r['link_rx_bytes'] / 1e6:.1f} MB tx/rx "
                    f"compile {r['compile_s']:.0f} s",
                    flush=True,
                )
            results[rate] = recs
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        cleanup()
    if results:
        print(table(results))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
