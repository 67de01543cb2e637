"""Shaping one end of the benchmark's link with `tc` (used by node.py, parsed by run.py)."""

from __future__ import annotations

import subprocess

UNSHAPED = "unshaped"


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


def tc_command(link: str, rate: str) -> list[str]:
    """The command that sets `link`'s egress to `rate`: a tbf with a burst of
    10 ms worth of bytes (at least 64 KiB), or no qdisc for `UNSHAPED`."""
    if rate == UNSHAPED:
        return ["tc", "qdisc", "del", "dev", link, "root"]
    burst = max(int(rate_bits(rate) / 8 / 100), 64 * 1024)
    return [
        "tc", "qdisc", "replace", "dev", link, "root", "tbf",
        "rate", rate, "burst", str(burst), "latency", "100ms",
    ]  # fmt: skip


def shape(link: str, rate: str, netns: str | None = None) -> None:
    """Apply `tc_command` (inside network namespace `netns` if given). Removing
    a qdisc that is not there is not an error."""
    cmd = tc_command(link, rate)
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 and not (rate == UNSHAPED and "No such file" in result.stderr):
        if rate == UNSHAPED and "Cannot delete qdisc with handle of zero" in result.stderr:
            return
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
