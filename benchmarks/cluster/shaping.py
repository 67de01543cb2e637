"""Shaping one end of the benchmark's link with `tc` (used by node.py, parsed by run.py)."""

from __future__ import annotations

import subprocess

UNSHAPED = "unshaped"
# What `tc qdisc del` says when the link has no qdisc of its own.
_NO_QDISC = "Cannot delete qdisc with handle of zero"


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as 10gbit, 1gbit or 200mbit
    (`UNSHAPED`: infinity, the veth pair's own speed)."""
    if rate == UNSHAPED:
        return float("inf")
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for suffix, scale in units.items():
        if rate.lower().endswith(suffix):
            try:
                return float(rate[: -len(suffix)]) * scale
            except ValueError:
                break
    raise ValueError(f"rate {rate!r}: write it like 10gbit, 1gbit, 200mbit or {UNSHAPED}")


def tc_command(link: str, rate: str, burst_ms: float = 1.0) -> list[str]:
    """The command that sets `link`'s egress to `rate`: a tbf whose bucket
    holds `burst_ms` worth of bytes (at least 16 KiB), or no qdisc for
    `UNSHAPED`.

    The bucket is how much a sender may push at the veth's own speed after
    the link was idle. A real link of that rate has none: every byte takes
    1/rate. A large bucket lets a program that sends in small pieces between
    computations (as activation collectives do) hide its link time in the
    refills, which a real link would not allow.
    """
    if rate == UNSHAPED:
        return ["tc", "qdisc", "del", "dev", link, "root"]
    burst = max(int(rate_bits(rate) / 8 * burst_ms / 1000), 16 * 1024)
    return [
        "tc", "qdisc", "replace", "dev", link, "root", "tbf",
        "rate", rate, "burst", str(burst), "latency", "100ms",
    ]  # fmt: skip


def shape(link: str, rate: str, burst_ms: float = 1.0) -> None:
    """Apply `tc_command`. Removing a qdisc that is not there is not an error."""
    cmd = tc_command(link, rate, burst_ms)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode == 0 or (rate == UNSHAPED and _NO_QDISC in result.stderr):
        return
    raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
