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

from zpp_jax.analysis.flops import peak_matrix_flops
from zpp_jax.overlap.hlo import (
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


# How the estimate queues the transfers of asynchronous collectives.
# "stream": one after another in the order they start, whichever links they
# cross: XLA:GPU runs every asynchronous collective (but point-to-point
# sends) on one communication stream (its `AsyncStreamKind::kCollective`),
# and a stream runs one kernel at a time. "link": one queue per link, as if
# the NIC and NVLink transfers ran on streams of their own. "none": any
# number in flight at once, each at its link's full bandwidth (what XLA's
# scheduler assumes; the step can then fall below what the links need).
QUEUES = ("stream", "link", "none")


@dataclasses.dataclass(frozen=True)
class ScheduleEstimate:
    """XLA:GPU's latency-hiding scheduler's cost model applied to the step it
    scheduled: `step_us`, the step's time, and `exposed_us`, per collective
    kind, the time the step waits on communication that the kernels
    scheduled while it is in flight do not cover; `exposed_by_op`, the same
    per op name (what the program was doing: a unit's scope, its gather or
    reduction) and kind, summed over the collectives that share them.
    `compute_us`: the kernels alone, the step if no transfer took time;
    `link_busy_us`: per link, the sum of its transfers' times, a floor
    under the step (with `queue` "stream" or "link", `step_us` is never
    below it); `queue`: how transfers waited for each other (`QUEUES`).
    `pallas_us`: the part of `compute_us` in the `pallas_calls` Pallas
    kernels, priced from the bytes they move at the GPU's memory bandwidth
    when `pallas_from_bytes`, else at XLA's flat cost. `peak_matrix_flops`:
    the GPU's dense bfloat16 matrix peak, FLOP/s, from the target
    description XLA compiled for (for MFU; None when unknown).

    The kernels' times are the scheduler's (derived from the target's
    description), but for the Pallas calls (above), and each collective's
    is the price it was scheduled with (the link model,
    `zpp_jax.overlap.links`): nothing was run.

    Only for a program without loops: a loop's body would count once.

    This counts what "behind a GEMM" (`Scheduled`) cannot: a collective
    behind one short GEMM is exposed for the rest of its time, and one
    behind other kernels (quantization, error feedback) is covered
    without any GEMM.
    """

    step_us: float
    exposed_us: dict[str, float]
    exposed_by_op: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    compute_us: float = 0.0
    link_busy_us: dict[str, float] = dataclasses.field(default_factory=dict)
    queue: str = "stream"
    pallas_us: float = 0.0
    pallas_calls: int = 0
    pallas_from_bytes: bool = False
    peak_matrix_flops: float | None = None

    @property
    def exposed_total_us(self) -> float:
        return sum(self.exposed_us.values())

    @property
    def busiest_link_us(self) -> float:
        return max(self.link_busy_us.values(), default=0.0)


def schedule_estimate(
    schedule_text: str,
    latency_us: dict[str, float],
    link_of: dict[str, str] | None = None,
    queue: str = "stream",
    memory_bytes_per_s: float | None = None,
) -> ScheduleEstimate | None:
    """The `ScheduleEstimate` of the schedule in a schedule dump (the
    ``*.schedule.txt`` that ``xla_dump_latency_hiding_schedule`` writes),
    with `latency_us` the time each asynchronous collective takes, by the
    name XLA's scheduler knows its start by (the latency profile it was
    given: `zpp_jax.overlap.links.collective_latencies_us`), and `link_of`
    the link each crosses, by the same names
    (`zpp_jax.overlap.links.collective_links`; absent names, or no
    `link_of`, count as one link "link").

    The schedule is walked in order as XLA's scheduler statistics walk
    it: each instruction adds its cost. A collective's transfer begins at
    its start or, when its queue (`queue`, one of `QUEUES`) is busy, when
    the transfer before it ends; its done waits for the transfer's end.
    (The statistics the dump itself carries are of the order before
    scheduling, every collective next to its own done, so they count nearly
    all communication as exposed.) XLA prices a Pallas kernel at a flat
    cost; with `memory_bytes_per_s` it costs a launch (`KERNEL_LAUNCH_US`)
    and the bytes it reads and writes (its operands and its result) at that
    bandwidth instead: the kernels are memory-bound. None when the
    dump holds no timed schedule, or a collective has no latency in
    `latency_us`."""
    if queue not in QUEUES:
        raise ValueError(f"queue must be one of {QUEUES}, got {queue!r}")
    instructions, schedules, per_us = _read_dump(schedule_text)
    if not schedules:
        return None
    walk = _Walk(instructions, latency_us, link_of or {}, queue, per_us, memory_bytes_per_s)
    for ident, cost in max(schedules, key=len):
        if not walk.step(ident, cost):
            return None
    return walk.estimate()


class _Walk:
    """`schedule_estimate`'s clock, queues and sums (in cycles)."""

    def __init__(self, instructions, latency_us, link_of, queue, per_us, bandwidth) -> None:
        self.instructions, self.latency_us, self.link_of = instructions, latency_us, link_of
        self.queue, self.per_us, self.bandwidth = queue, per_us, bandwidth
        self.pallas, self.pallas_calls = 0.0, 0  # the Pallas kernels' cycles and calls
        self.now = self.compute = 0.0
        self.free: dict[str, float] = {}  # per queue: when its last transfer ends
        self.ends: dict[int, float] = {}  # per started collective: when its transfer ends
        self.exposed = dict.fromkeys(KINDS, 0.0)
        self.by_op: dict[str, dict[str, float]] = {}
        self.busy: dict[str, float] = {}

    def step(self, ident: int, cost: float) -> bool:
        """Walk one instruction; False when a collective has no latency."""
        info = self.instructions.get(ident, {})
        if info.get("custom_call_target") == PALLAS_TARGET:
            cost = self._pallas_cost(info, cost)
        self.now += cost
        self.compute += cost
        if _started_kind(info):
            latency = self.latency_us.get(info.get("name"))
            if latency is None:
                return False
            link = self.link_of.get(info.get("name"), "link")
            self.busy[link] = self.busy.get(link, 0.0) + latency
            key = {"stream": "stream", "link": link, "none": ident}[self.queue]
            begin = max(float(int(self.now)), self.free.get(key, 0.0))  # whole cycles, as XLA's
            self.ends[ident] = self.free[key] = begin + latency * self.per_us
        elif info.get("opcode", "").endswith("-done") and info.get("operand") in self.ends:
            start = self.instructions[info["operand"]]
            wasted = max(0.0, self.ends[info["operand"]] - self.now)
            self.now += wasted
            kind = _started_kind(start)
            self.exposed[kind] += wasted / self.per_us
            kinds = self.by_op.setdefault(start.get("op_name", ""), {})
            kinds[kind] = kinds.get(kind, 0.0) + wasted / self.per_us
        return True

    def _pallas_cost(self, info: dict, flat: float) -> float:
        """A Pallas kernel's cycles: a launch and its bytes at the memory
        bandwidth, or XLA's flat cost without one."""
        cost = flat
        if self.bandwidth:
            operands = sum(self.instructions.get(o, {}).get("bytes", 0) for o in info["operands"])
            moved_s = (info.get("bytes", 0) + operands) / self.bandwidth
            cost = (KERNEL_LAUNCH_US + moved_s * 1e6) * self.per_us
        self.pallas += cost
        self.pallas_calls += 1
        return cost

    def estimate(self) -> ScheduleEstimate:
        us = self.per_us
        return ScheduleEstimate(
            self.now / us,
            self.exposed,
            self.by_op,
            self.compute / us,
            self.busy,
            self.queue,
            self.pallas / us,
            self.pallas_calls,
            self.bandwidth is not None,
        )


def _started_kind(info: dict) -> str | None:
    """The collective kind an instruction starts (an all-to-all starts as a
    generic ``async-start`` named after it), else None."""
    opcode, name = info.get("opcode", ""), info.get("name", "")
    for kind in KINDS:
        if opcode == f"{kind}-start" or (opcode == "async-start" and name.startswith(kind)):
            return kind
    return None


# Bytes per element of XLA's element types (a 4-bit type packs two).
_ELEMENT_BYTES = {
    "PRED": 1, "S4": 0.5, "U4": 0.5, "S8": 1, "U8": 1, "S16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "S32": 4, "U32": 4, "F32": 4, "S64": 8, "U64": 8, "F64": 8, "C64": 8, "C128": 16,
}  # fmt: skip
# A Pallas kernel as XLA:GPU calls it, and what a kernel launch costs in
# XLA:GPU's performance model (its kKernelLaunchOverhead).
PALLAS_TARGET = "__gpu$xla.gpu.triton"
KERNEL_LAUNCH_US = 1.0


def _read_dump(text: str) -> tuple[dict[int, dict], list[list[tuple[int, float]]], float]:
    """(Instructions by id: name, opcode, op name, first operand, all
    operands, custom-call target, result bytes; each computation's schedule
    as (id, cost in cycles) in order; cycles per microsecond) of a schedule
    dump in protobuf text format."""
    instructions: dict[int, dict] = {}
    schedules: list[list[tuple[int, float]]] = []
    per_us, current, timed, shape = 1.0, None, None, None
    for line in text.splitlines():
        if shape is not None:  # inside an instruction's result shape
            if line == "      }":
                current["bytes"], shape = _shape_bytes(shape), None
            else:
                shape.append(line)
        elif line == "    instructions {":  # an instruction of the HLO module
            current = {}
        elif line == "      shape {" and current is not None:
            shape = []
        elif line.startswith("      ") and current is not None and not line.startswith("       "):
            key, _, value = line.strip().partition(": ")
            if key in ("name", "opcode", "custom_call_target"):
                current[key] = value.strip('"')
            elif key == "id":
                instructions[int(value)] = current
            elif key == "operand_ids":
                current.setdefault("operand", int(value))
                current.setdefault("operands", []).append(int(value))
        elif line.startswith("        op_name: ") and current is not None:
            current.setdefault("op_name", line.split(": ", 1)[1][1:-1])
        elif line.startswith("computation_schedules"):
            current, timed = None, []
            schedules.append(timed)
        elif timed is not None and line.startswith("    id: "):
            timed.append([int(line[8:]), 0.0, 0.0])
        elif timed is not None and line.startswith("    start_timestamp_cycles: "):
            timed[-1][1] = float(line.split(": ")[1])
        elif timed is not None and line.startswith("    end_timestamp_cycles: "):
            timed[-1][2] = float(line.split(": ")[1])
        elif line.startswith("  cycles_per_microsecond: "):
            per_us = float(line.split(": ")[1]) or 1.0
    timed_schedules = [[(i, e - s) for i, s, e in sched] for sched in schedules]
    return instructions, timed_schedules, per_us


def _shape_bytes(lines: list[str]) -> float:
    """The bytes of a shape (the lines inside ``shape { }``): an array's
    elements, or the sum over a tuple's arrays. A ``dimensions`` line
    belongs to the ``element_type`` at its own depth (a layout's tiles have
    dimensions of their own, deeper)."""
    arrays: list[list] = []  # [depth, bytes per element, elements]
    for line in lines:
        depth, text = len(line) - len(line.lstrip()), line.strip()
        if text.startswith("element_type: "):
            arrays.append([depth, _ELEMENT_BYTES.get(text.split(": ")[1], 0), 1])
        elif text.startswith("dimensions: ") and arrays and arrays[-1][0] == depth:
            arrays[-1][2] *= int(text.split(": ")[1])
    return sum(size * count for _, size, count in arrays)


def dumped_target_description(dump: Path) -> str:
    """The GPU target description XLA wrote into `dump`
    (``*.gpu_target_config.pbtxt``, text format; "" without one)."""
    found = sorted(dump.glob("*gpu_target_config.pbtxt"))
    return found[0].read_text() if found else ""


def memory_bandwidth(dump: Path) -> float | None:
    """Bytes per second of the GPU memory, from the target description XLA
    wrote into `dump` (`dumped_target_description`); None without one."""
    return _memory_bandwidth_in(dumped_target_description(dump))


def _memory_bandwidth_in(description: str) -> float | None:
    found = re.search(r"^\s*memory_bandwidth:\s*(\d+)", description, re.M)
    return float(found.group(1)) if found else None


def read_estimate(
    dump: Path,
    latency_us: dict[str, float],
    link_of: dict[str, str] | None = None,
    queue: str = "stream",
) -> ScheduleEstimate | None:
    """The estimate of the step dumped in `dump` (`schedule_estimate`): of
    the longest module, if XLA compiled more than the step into it; its
    Pallas kernels priced at the memory bandwidth of the GPU XLA compiled
    for (`memory_bandwidth`), with that GPU's matrix peak
    (`zpp_jax.analysis.flops.peak_matrix_flops`); the description is read
    once for both."""
    description = dumped_target_description(dump)
    bandwidth = _memory_bandwidth_in(description)
    files = sorted(dump.glob("*.schedule.txt"))
    estimates = [
        schedule_estimate(f.read_text(), latency_us, link_of, queue, bandwidth) for f in files
    ]
    longest = max((e for e in estimates if e is not None), key=lambda e: e.step_us, default=None)
    if longest is None:
        return None
    return dataclasses.replace(longest, peak_matrix_flops=peak_matrix_flops(description))
