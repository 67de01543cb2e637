"""Two nodes on one machine, joined by a link of a chosen bandwidth.

    sudo python benchmarks/cluster/run.py                       # 1 Gbit/s
    sudo python benchmarks/cluster/run.py --rates 10gbit 1gbit 200mbit
    sudo python benchmarks/cluster/run.py --sweep --out DIR     # 3 models x 2 batches, a page
    python benchmarks/cluster/run.py --no-network               # one process, 2 x 4

Builds two network namespaces (`zppbench0`, `zppbench1`) joined by a veth pair
whose both ends are shaped with `tc ... tbf` to the rate, maps this machine's
hostname to each namespace's own address in `/etc/netns/<ns>/hosts` (gloo
binds to the hostname's address), and runs `node.py` in each namespace: two
`jax.distributed` processes with 4 CPU devices each, a 2 x 4 (node, local)
mesh. Each node compiles each method once and, for every rate, shapes its own
end of the link and times the step. It prints the median step time of
ZeRO-3, ZeRO++ and plain `jax.jit`, the bytes that crossed the link per step,
the ratios, and each method's distance from its physical floor: max(its step
on the unshaped link, its link bytes / rate). `--sweep` does this for the
README model and d_model 768 and 1024 (d_ff 4x) at 16 and 32 tokens per
device, one table for all. `--no-network` times the three methods in one
process on 8 devices (2 x 4 mesh, no link at all; no root needed).
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
sys.path.insert(0, str(HERE))

import page  # noqa: E402
import shaping  # noqa: E402


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _in_ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh("ip", "netns", "exec", ns, *cmd, check=check)


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


def node_env(
    process_id: int, system_malloc: bool = False, processes: int = 2, port: int = PORT
) -> dict[str, str]:
    """The environment of node `process_id` of `processes`: this one without
    XLA_/JAX_ settings (each node sets its own devices), the coordinator of
    the processes on `port` (none for one), 8 // processes CPU devices each, and
    MALLOC_ENV unless `system_malloc` (a MALLOC_ variable set by the caller
    wins)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    if not system_malloc:
        env = {**MALLOC_ENV, **env}
    env.update(ZPP_LOCAL_CPU_DEVICES=str(8 // processes), TF_CPP_MIN_LOG_LEVEL="2")
    if processes > 1:
        env.update(
            ZPP_COORDINATOR_ADDRESS=f"{ADDRESSES[0]}:{port}",
            ZPP_NUM_PROCESSES=str(processes),
            ZPP_PROCESS_ID=str(process_id),
        )
    return env


def parse_records(stdout: str) -> list[dict]:
    """The records node.py printed (its ``RESULT {json}`` lines)."""
    return [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def run_nodes(
    node_args: list[str], timeout: float, system_malloc: bool = False, port: int = PORT
) -> list[dict]:
    """Run node.py in both namespaces, their coordinator on `port` (a port
    of its own per run: the last run's may still be held by the kernel);
    the records printed by process 0."""
    procs = []
    try:
        for i, (ns, link) in enumerate(zip(NAMESPACES, LINKS, strict=True)):
            env = node_env(i, system_malloc, port=port)
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
        return parse_records(outs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


METHODS = ("zero3", "zeropp", "jit", "jit_fsdp")
SWEEP_MODELS = (  # (d_model, d_ff, heads): the README model, then two it was not tuned on
    (512, 2048, 8),
    (768, 3072, 12),
    (1024, 4096, 16),
)
SWEEP_TOKENS = (16, 32)  # per device: batch 8 x seq tokens over 8 devices
SWEEP_RATES = ("10gbit", "1gbit", "200mbit")


def run_local(node_args: list[str], timeout: float, system_malloc: bool = False) -> list[dict]:
    """node.py in one process with 8 CPU devices on a 2 x 4 mesh: no link."""
    env = node_env(0, system_malloc, processes=1)
    cmd = [sys.executable, str(HERE / "node.py"), "--mesh", "2x4", *node_args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"node.py exited with {r.returncode}:\n{r.stderr[-3000:]}")
    return parse_records(r.stdout)


def _link_s(rec: dict) -> float:
    """Seconds the link needs per step for this record's bytes at its rate
    (the busier direction)."""
    bits = shaping.rate_bits(rec["rate"]) if rec.get("rate") else float("inf")
    return _bytes(rec) * 8 / bits


def table(records: list[dict]) -> str:
    """One row per (model, tokens per device, rate): each method's median
    step ("-" where it did not run), ZeRO++'s speedup against each other
    method, the bytes each way, and each method's step over its floor
    max(compute, link time), where compute is the method's step on the
    unshaped link (when it was run)."""
    names = {"zero3": "ZeRO-3", "zeropp": "ZeRO++", "jit": "jit", "jit_fsdp": "jit (FSDP)"}
    others = [m for m in METHODS if m != "zeropp"]
    header = ["d_model", "tokens/device", "link", *(names[m] for m in METHODS)]
    header += [f"ZeRO++ vs {names[m]}" for m in others]
    header += [f"MB/step each way ({' / '.join(names[m] for m in METHODS)})", "step / floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    key = lambda r: (r["model"]["d_model"], r["tokens_per_device"])  # noqa: E731
    compute = {(key(r), r["method"]): r["median_s"] for r in records if r.get("rate") == "unshaped"}
    rows: dict = {}
    for r in records:
        rows.setdefault((key(r), r.get("rate")), {})[r["method"]] = r
    for ((d, tokens), rate), by in rows.items():
        if "zeropp" not in by:
            continue
        zpp = by["zeropp"]["median_s"]
        steps = [f"{by[m]['median_s']:.3f} s" if m in by else "-" for m in METHODS]
        ratios = [f"{by[m]['median_s'] / zpp:.2f}x" if m in by else "-" for m in others]
        mb = [f"{_bytes(by[m]) / 1e6:.1f}" if m in by else "-" for m in METHODS]
        floors = []
        for m in METHODS:
            c = compute.get(((d, tokens), m))
            floors.append(f"{by[m]['median_s'] / max(c, _link_s(by[m])):.2f}" if c else "-")
        cells = [str(d), str(tokens), rate or "no network", *steps, *ratios]
        lines.append("| " + " | ".join([*cells, " / ".join(mb), " / ".join(floors)]) + " |")
    return "\n".join(lines)


def _bytes(rec: dict) -> float:
    return max(rec["link_tx_bytes"], rec["link_rx_bytes"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Two-node ZeRO++ benchmark over a shaped link.")
    p.add_argument(
        "--rates",
        nargs="+",
        default=None,
        help="link rates to run in turn (tc syntax: 10gbit, 1gbit, 200mbit; or unshaped); "
        "default 1gbit, with --sweep 10gbit 1gbit 200mbit unshaped",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="d_model 512, 768, 1024 (d_ff 4x) at 16 and 32 tokens per device",
    )
    p.add_argument(
        "--no-network",
        action="store_true",
        help="one process, 8 devices on a 2 x 4 mesh, no link (no root needed)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per node run")
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="also write a results page here: two_nodes.json, two_nodes.png, report.md",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier page in --out")
    p.add_argument(
        "--render",
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help="only write DIR's page and plot again from its two_nodes.json (measures nothing)",
    )
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="keep glibc's default mmap and trim thresholds in the nodes (see MALLOC_ENV)",
    )
    return p


def main(argv=None) -> None:
    args, node_args = _parser().parse_known_args(argv)
    if args.render:
        made = json.loads((args.render / "two_nodes.json").read_text())
        page.render(args.render, made, table(made["records"]))
        return
    if args.out:
        page.prepare(args.out, args.overwrite)
    rates = args.rates or ([*SWEEP_RATES, "unshaped"] if args.sweep else ["1gbit"])
    for rate in rates:
        shaping.rate_bits(rate)
    runs = [node_args]
    if args.sweep:
        runs = [
            [
                *node_args,
                *("--d-model", str(d), "--d-ff", str(ff), "--heads", str(h)),
                *("--seq", str(tokens), "--batch", "8"),
            ]
            for d, ff, h in SWEEP_MODELS
            for tokens in SWEEP_TOKENS
        ]
    collected: list[dict] = []

    def report(recs):
        for r in recs:
            print(
                f"  d_model {r['model']['d_model']} tokens/device {r['tokens_per_device']} "
                f"{r.get('rate') or 'no network'}: {r['method']:7s} median {r['median_s']:.3f} s "
                f"times {[round(t, 3) for t in r['times_s']]} link "
                f"{r['link_tx_bytes'] / 1e6:.1f}/{r['link_rx_bytes'] / 1e6:.1f} MB tx/rx "
                f"compile {r['compile_s']:.0f} s",
                flush=True,
            )
        collected.extend(recs)

    if args.no_network:
        for run_args in runs:
            report(run_local(run_args, args.timeout, args.system_malloc))
        _finish(collected, args.out)
        return
    if os.geteuid() != 0:
        sys.exit(
            "benchmarks/cluster/run.py needs root (it creates network namespaces and "
            "shapes them with tc): run it with sudo, or pass --no-network"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.exit(f"`{tool}` not found: install iproute2")

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    failed = None
    try:
        setup()
        for i, run_args in enumerate(runs):
            node_args = [*run_args, "--rates", *rates]
            report(run_nodes(node_args, args.timeout, args.system_malloc, PORT + i))
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
    except RuntimeError as e:  # a node failed: keep what the others measured
        failed = e
    finally:
        cleanup()
    _finish(collected, args.out if failed is None else None)
    if failed is not None:
        sys.exit(f"stopped: {failed}")


def _finish(records: list[dict], out: pathlib.Path | None) -> None:
    if not records:
        return
    if out:
        page.write(out, records, table(records))
    else:
        print(table(records))


if __name__ == "__main__":
    main()
