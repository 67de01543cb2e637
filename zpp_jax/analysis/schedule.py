"""What each collective of a scheduled GPU program runs behind.

`schedule_overlap` reads, from a scheduled HLO module (instructions in
execution order), the matrix multiplies that run while each asynchronous
collective is in flight, and whether any could (`Scheduled.hideable`);
`schedule_estimate` reads XLA's own estimate of the step and of the
communication no compute covers from its schedule dump.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

from zpp_jax.analysis.hlo import (
    INSTRUCTION,
    KINDS,
    callees,
    computations,
    op_name,
    runs_per_computation,
)

_ASYNC_START = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.+?\s+"
    r"(?P<kind>" + "|".join(KINDS) + r")-start\((?P<args>.*)$"
)
_DONE = re.compile(r"\s(?P<kind>" + "|".join(KINDS) + r")-done\(%(?P<start>[\w.\-]+)\)")
_SYNC_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.+?\s+(?P<kind>" + "|".join(KINDS) + r")\("
)
# A matrix multiply as the GPU backend emits it: a dot or convolution, a
# library call (cuBLAS, cuBLASLt, cuDNN) or a Triton GEMM fusion.
_GEMM = re.compile(
    r"\s(?:dot|convolution)\(|custom_call_target=\"__cu(?:blas|dnn)[^\"]*\"|"
    r"\"kind\":\"__(?:triton_gemm|triton_nested_gemm_fusion|cublas[^\"]*|cudnn[^\"]*)\""
)


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One collective of a scheduled program and what it runs behind.

    behind: the matrix multiplies scheduled between its start and its done
    (their op names), empty when it runs alone or synchronously.
    hideable: some matrix multiply of its computation (the program, or one
    iteration of a loop) neither feeds its start nor needs its result, so
    that a schedule of this program could run it behind one. False for,
    typically, the gradient reductions of the units whose backward pass
    comes last: no schedule can hide those.
    """

    name: str
    kind: str
    runs: int
    is_async: bool
    behind: tuple[str, ...]
    op: str = ""  # the collective's own op name (what the program was doing)
    hideable: bool = True

    @property
    def overlapped(self) -> bool:
        return bool(self.behind)


def schedule_overlap(hlo_text: str) -> list[Scheduled]:
    """Every collective of a scheduled HLO module (``compiled.as_text()``
    of a GPU program: instructions in execution order) with the matrix
    multiplies that run while it is in flight: those between its
    ``-start`` and its ``-done``, directly or inside a fusion, loop or call
    between them. A collective XLA made synchronous (``"is_sync":true``)
    or never split into start and done runs behind nothing. `runs` as in
    `collectives_in_hlo`."""
    entry, bodies = computations(hlo_text)
    runs = runs_per_computation(entry, bodies)
    gemm: dict[str, bool] = {}

    def has_gemm(name: str) -> bool:
        if name not in gemm:
            gemm[name] = False  # no recursion through a cycle
            gemm[name] = any(_line_has_gemm(line) for line in bodies.get(name, []))
        return gemm[name]

    def _line_has_gemm(line: str) -> bool:
        return bool(_GEMM.search(line)) or any(has_gemm(c) for c in callees(line))

    found = []
    for comp, lines in bodies.items():
        graph = None  # built for the computations that hold a collective
        for i, line in enumerate(lines):
            start = _ASYNC_START.match(line)
            plain = None if start else _SYNC_COLLECTIVE.match(line)
            if (start or plain) and graph is None:
                graph = _Dataflow(lines, _line_has_gemm)
            if start:
                name = start.group("name")
                behind = []
                sync = '"is_sync":true' in line
                done_name = name
                for later in lines[i + 1 :]:
                    done = _DONE.search(later)
                    if done and done.group("start") == name:
                        done_name = INSTRUCTION.match(later).group("name")
                        break
                    named = INSTRUCTION.match(later)
                    if not sync and named and named.group("name") in graph.gemms:
                        behind.append(op_name(later) or named.group("name"))
                found.append(
                    Scheduled(
                        name,
                        start.group("kind"),
                        runs.get(comp, 1),
                        not sync,
                        tuple(behind),
                        op_name(line),
                        graph.has_independent_gemm(name, done_name),
                    )
                )
                continue
            if plain and not _DONE.search(line):
                found.append(
                    Scheduled(
                        plain.group("name"),
                        plain.group("kind"),
                        runs.get(comp, 1),
                        False,
                        (),
                        op_name(line),
                        graph.has_independent_gemm(plain.group("name"), plain.group("name")),
                    )
                )
    return found


class _Dataflow:
    """The operand graph of one computation's instructions (operands and
    control predecessors), and which of them are matrix multiplies."""

    def __init__(self, lines: list[str], is_gemm: Callable[[str], bool]) -> None:
        self.operands: dict[str, list[str]] = {}
        self.users: dict[str, list[str]] = {}
        self.gemms: set[str] = set()
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            name = m.group("name")
            rhs = line.split("=", 1)[1].split("metadata=")[0]
            refs = [r for r in re.findall(r"%([\w.\-]+)", rhs) if r != name]
            self.operands[name] = refs
            for r in refs:
                self.users.setdefault(r, []).append(name)
            if is_gemm(line):
                self.gemms.add(name)

    def _reach(self, start: str, edges: dict[str, list[str]]) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def has_independent_gemm(self, start: str, done: str) -> bool:
        """Whether a matrix multiply neither feeds `start` nor uses `done`."""
        if not self.gemms:
            return False
        tied = self._reach(start, self.operands) | self._reach(done, self.users)
        return bool(self.gemms - tied)


def overlap_by_kind(scheduled: list[Scheduled]) -> dict[str, tuple[int, int]]:
    """Per collective kind: (runs per step behind a matrix multiply, runs per step)."""
    out: dict[str, tuple[int, int]] = {}
    for s in scheduled:
        hit, total = out.get(s.kind, (0, 0))
        out[s.kind] = (hit + s.runs * s.overlapped, total + s.runs)
    return out


def unhideable_by_kind(scheduled: list[Scheduled]) -> dict[str, int]:
    """Per collective kind: runs per step that no schedule of the program
    can run behind a matrix multiply (not `Scheduled.hideable`)."""
    out: dict[str, int] = {}
    for s in scheduled:
        out[s.kind] = out.get(s.kind, 0) + s.runs * (not s.hideable)
    return out


@dataclasses.dataclass(frozen=True)
class ScheduleEstimate:
    """XLA:GPU's latency-hiding scheduler's own estimate of the step it
    scheduled, from its cost model (kernel and collective times it derives
    from the target's description, and a fixed cost for a kernel it cannot
    model, such as a Pallas call; no measurement): `step_us`, the step's
    time, and `exposed_us`, per collective kind, the time the step waits on
    communication that no compute scheduled while it is in flight covers.

    Only for a program without loops: the statistics count a loop's body
    once (`step_report` withholds them then).

    This counts what "behind a GEMM" (`Scheduled`) cannot: a collective
    behind one short GEMM is exposed for the rest of its time, and one
    behind other kernels (quantization, error feedback) is covered
    without any GEMM. Both are the model's view of a program it has not
    run: kernel times without autotuning, links at the description's speed.
    """

    step_us: float
    exposed_us: dict[str, float]

    @property
    def exposed_total_us(self) -> float:
        return sum(self.exposed_us.values())


_WASTED = re.compile(r"^\s*(?P<kind>\w+?)_wasted_cycles:\s*(?P<value>[\d.eE+-]+)", re.M)


def schedule_estimate(schedule_text: str) -> ScheduleEstimate | None:
    """The `ScheduleEstimate` in a schedule dump (the ``*.schedule.txt``
    that ``xla_dump_latency_hiding_schedule`` writes); None when it has no
    scheduler statistics. Every collective kind is listed, 0 when none of
    it is exposed (the dump leaves zeros out)."""
    _, found, stats = schedule_text.rpartition("scheduler_statistics {")
    stats = stats.split("}", 1)[0]
    total = re.search(r"total_cycles:\s*([\d.eE+-]+)", stats)
    if not found or total is None:
        return None
    rate = re.search(r"cycles_per_microsecond:\s*([\d.eE+-]+)", schedule_text)
    per_us = float(rate.group(1)) if rate else 1.0
    wasted = {
        m.group("kind").replace("_", "-"): float(m.group("value")) for m in _WASTED.finditer(stats)
    }
    exposed = {kind: wasted.get(kind, 0.0) / per_us for kind in KINDS}
    return ScheduleEstimate(float(total.group(1)) / per_us, exposed)


def read_estimate(dump: Path) -> ScheduleEstimate | None:
    """The estimate of the step dumped in `dump`: of the longest module, if
    XLA compiled more than the step into it."""
    files = sorted(dump.glob("*.schedule.txt"))
    estimates = [e for e in (schedule_estimate(f.read_text()) for f in files) if e is not None]
    return max(estimates, key=lambda e: e.step_us, default=None)
