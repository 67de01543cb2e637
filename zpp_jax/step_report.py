"""What a compiled step moves and keeps, read from the compiled program.

`collectives_in_hlo` lists every collective of an HLO text (kind, dtypes,
bytes, replica groups, runs per step with loop trip counts); `summarize`
totals the bytes a device moves per step by the ring model, across and
inside nodes; `step_report` does both for a `Trainer`'s compiled step, with
its peak memory (`memory_analysis()`). Works on programs compiled for any
target, CPU or GPU. On a GPU, `schedule_overlap` reads what each
collective is scheduled behind, and `schedule_estimate` XLA's own estimate
of the step and of the communication no compute covers.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

_COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>" + "|".join(_COLLECTIVES) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(?P<body>(?:\{[\d,]*\},?)*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<span>[^}]*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_WHILE = re.compile(r"\bwhile\(.*?body=%(?P<body>[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%(?P<name>[\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO module.

    result_bytes: bytes of its result on one device (tuple results summed).
    dtypes: element types of the result arrays.
    groups: the device groups it runs over (partition ids, mesh order).
    """

    name: str
    kind: str
    dtypes: tuple[str, ...]
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    runs: int = 1

    @property
    def moved_bytes(self) -> float:
        """Bytes one device sends per run, by the ring model: all-gather,
        reduce-scatter and all-to-all move (g-1)/g of the full buffer,
        all-reduce 2(g-1)/g, a permute its whole buffer."""
        g = self.group_size
        if self.kind == "collective-permute":
            return float(self.result_bytes)
        if g <= 1:
            return 0.0
        full = self.result_bytes * (g if self.kind == "reduce-scatter" else 1)
        factor = 2 if self.kind == "all-reduce" else 1
        return factor * full * (g - 1) / g

    def spans_nodes(self, local_size: int) -> bool:
        """Whether any group holds devices of two nodes (node = id // local_size)."""
        return any(len({d // local_size for d in g}) > 1 for g in self.groups)

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 0


_SCHEDULING_NAME = re.compile(r'scheduling_name="(?P<name>[^"]+)"')


def scheduling_names(hlo_text: str) -> dict[str, str]:
    """Each instruction's name as XLA's scheduler knew it (its
    ``scheduling_name``), by its name in `hlo_text`, where they differ."""
    out = {}
    for line in hlo_text.splitlines():
        m, s = _NAME.match(line), _SCHEDULING_NAME.search(line)
        if m and s and s.group("name") != m.group("name"):
            out[m.group("name")] = s.group("name")
    return out


def collectives_in_hlo(hlo_text: str) -> list[Collective]:
    """Every collective instruction in compiled HLO text, in text order.

    `runs` is how many times it executes per call of the entry computation:
    loop trip counts (XLA's known_trip_count) multiplied through nested loops.
    A loop whose trip count XLA does not know counts once.
    """
    entry, bodies = _computations(hlo_text)
    runs = _runs_per_computation(entry, bodies)
    found = []
    for computation, lines in bodies.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            shape = m.group("shape")
            if m.group("kind") != "all-reduce" and line[m.end() - 7 : m.end()] == "-start(":
                shape = _async_result(shape)
            arrays = _ARRAY.findall(shape)
            dtypes = tuple(dt for dt, _ in arrays)
            nbytes = sum(
                math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt]
                for dt, dims in arrays
            )
            found.append(
                Collective(
                    m.group("name"),
                    m.group("kind"),
                    dtypes,
                    int(nbytes),
                    _groups(line),
                    runs.get(computation, 1),
                )
            )
    return found


def _computations(hlo_text: str) -> tuple[str | None, dict[str | None, list[str]]]:
    """The entry computation's name and every computation's lines after its
    header, in text order; lines before the first header (a fragment of
    instructions) under None."""
    entry, bodies = None, {}
    lines = bodies[None] = []
    for line in hlo_text.splitlines():
        c = _COMPUTATION.match(line)
        if c:
            lines = bodies[c.group("name")] = []
            if line.startswith("ENTRY"):
                entry = c.group("name")
        else:
            lines.append(line)
    return entry, bodies


def _async_result(shape: str) -> str:
    """The result part of an async start's shape, which XLA:GPU writes as
    the tuple (operands, results) for every collective but all-reduce."""
    if not shape.startswith("("):
        return shape
    parts, depth, begin = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(shape[begin:i])
            begin = i + 1
    parts.append(shape[begin : shape.rindex(")")])
    parts = [p.strip() for p in parts if p.strip()]
    return parts[-1] if len(parts) == 2 else shape


def _runs_per_computation(
    entry: str | None, bodies: dict[str | None, list[str]]
) -> dict[str | None, int]:
    """Runs of each computation per call of `entry`: loop bodies by their
    known trip count, everything else it calls once per call."""
    calls: dict[str, list[tuple[str, int]]] = {}
    for computation, lines in bodies.items():
        calls[computation] = []
        for line in lines:
            w = _WHILE.search(line)
            trip = _TRIP.search(line)
            if w:
                calls[computation].append((w.group("body"), int(trip.group("n")) if trip else 1))
            for called in _callees(line):
                if not (w and called == w.group("body")):
                    calls[computation].append((called, 1))
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for callee, trip in calls.get(name, []):
            visit(callee, times * trip)

    if entry is not None:
        visit(entry, 1)
    return runs


@dataclasses.dataclass(frozen=True)
class CommSummary:
    """Bytes one device moves per call, split by whether the group spans nodes."""

    cross_node_bytes: float
    intra_node_bytes: float
    collectives: tuple[Collective, ...]


def summarize(hlo_text: str, local_size: int) -> CommSummary:
    """Per-device bytes per call of a compiled program, by the ring model, with
    loop trip counts applied. A collective whose group holds devices of two
    nodes counts wholly as cross-node traffic."""
    cs = collectives_in_hlo(hlo_text)
    cross = sum(c.moved_bytes * c.runs for c in cs if c.spans_nodes(local_size))
    intra = sum(c.moved_bytes * c.runs for c in cs if not c.spans_nodes(local_size))
    return CommSummary(cross, intra, tuple(cs))


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    m = _MESH_GROUPS.search(line)
    if m:
        # mesh['a'=2,'b'=4] {'b'}: devices numbered row-major over the
        # named axes; a group is the devices that differ only along the
        # axes in braces.
        axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", m.group("axes"))]
        span = re.findall(r"'(\w+)'", m.group("span"))
        names = [name for name, _ in axes]
        ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
        moved = [names.index(a) for a in span]
        ids = np.moveaxis(ids, moved, list(range(len(names) - len(moved), len(names))))
        size = math.prod(dict(axes)[a] for a in span)
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))
    m = _IOTA_GROUPS.search(line)
    if m:
        dims = [int(d) for d in m.group("dims").split(",")]
        reshape = [int(d) for d in m.group("reshape").split(",")]
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if m.group("perm"):
            ids = ids.transpose([int(p) for p in m.group("perm").split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(dims))
    m = _EXPLICIT_GROUPS.search(line)
    if m:
        body = m.group("body")
        return tuple(
            tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", body)
        )
    m = re.search(r"source_target_pairs=\{(?P<body>(?:\{\d+,\d+\},?)*)\}", line)
    if m:
        return tuple(
            tuple(int(i) for i in p.split(","))
            for p in re.findall(r"\{(\d+,\d+)\}", m.group("body"))
        )
    return ()


def step_report(trainer, batch: dict) -> dict:
    """Compile `trainer.train_step` for `batch` (arrays or shape/dtype structs,
    nothing is run) and report its collectives, bytes per device per step
    across and inside nodes, peak memory per device, and, per collective,
    the matrix multiplies it is scheduled behind (`schedule_overlap`; none
    on CPU, whose collectives are synchronous) and whether any could be
    (`Scheduled.hideable`; those that cannot, per kind, under
    "unhideable"). On a GPU mesh, "estimate" is the scheduler's own
    estimate of the step and of the communication it left exposed
    (`ScheduleEstimate`); None elsewhere, and None, with the reason in
    "estimate_withheld", for a program with a loop: the scheduler's
    statistics count a loop's body once, not once per iteration. The
    trainer may be abstract (built on an ``nnx.eval_shape`` model, for a
    compile-only mesh); anything with the same `mesh`, `compiler_options`,
    `compile_step` and `abstract_state` will do (`zpp_jax.JitFSDP`)."""
    from zpp_jax.mesh import mesh_shape
    from zpp_jax.schedule import schedules_overlap

    estimate = None
    if schedules_overlap(trainer.mesh):
        with tempfile.TemporaryDirectory() as dump:
            options = {
                **trainer.compiler_options,
                "xla_dump_to": dump,
                "xla_dump_latency_hiding_schedule": True,
            }
            compiled = trainer.compile_step(batch, options)
            estimate = _read_estimate(Path(dump))
    else:
        compiled = trainer.compile_step(batch)
    _, local = mesh_shape(trainer.mesh)
    text = compiled.as_text()
    withheld = None
    if estimate is not None and _WHILE.search(text):
        estimate, withheld = None, "the program has a loop, whose body XLA's statistics count once"
    summary = summarize(text, local)
    behind = {s.name: s for s in schedule_overlap(text)}
    ma = compiled.memory_analysis()
    peak = (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        + ma.temp_size_in_bytes
        - ma.alias_size_in_bytes
    )
    return {
        "cross_node_bytes": summary.cross_node_bytes,
        "intra_node_bytes": summary.intra_node_bytes,
        "peak_memory_bytes": int(peak),
        "state_bytes": state_bytes_per_device(trainer.abstract_state()),
        "overlap": {k: list(v) for k, v in overlap_by_kind(list(behind.values())).items()},
        "unhideable": unhideable_by_kind(list(behind.values())),
        "estimate": None if estimate is None else dataclasses.asdict(estimate),
        "estimate_withheld": withheld,
        "collectives": [
            {
                "kind": c.kind,
                "dtypes": list(c.dtypes),
                "bytes": c.result_bytes,
                "moved_bytes": c.moved_bytes,
                "replica_groups": [list(g) for g in c.groups],
                "runs": c.runs,
                "spans_nodes": c.spans_nodes(local),
                "async": c.name in behind and behind[c.name].is_async,
                "behind": list(behind[c.name].behind) if c.name in behind else [],
                "op": behind[c.name].op if c.name in behind else "",
                "hideable": c.name not in behind or behind[c.name].hideable,
            }
            for c in summary.collectives
        ],
    }


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
    exposed = {kind: wasted.get(kind, 0.0) / per_us for kind in _COLLECTIVES}
    return ScheduleEstimate(float(total.group(1)) / per_us, exposed)


def _read_estimate(dump: Path) -> ScheduleEstimate | None:
    """The estimate of the step dumped in `dump`: of the longest module, if
    XLA compiled more than the step into it."""
    files = sorted(dump.glob("*.schedule.txt"))
    estimates = [e for e in (schedule_estimate(f.read_text()) for f in files) if e is not None]
    return max(estimates, key=lambda e: e.step_us, default=None)


def state_bytes_per_device(state) -> int:
    """Bytes of a state tree one device holds (the largest per-device
    share): of arrays, or of shape/dtype structs with shardings."""
    import jax

    per_device: dict = {}
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            shards = leaf.sharding.devices_indices_map(leaf.shape).items()
            for device, index in shards:
                size = math.prod(
                    len(range(*i.indices(n))) for i, n in zip(index, leaf.shape, strict=True)
                )
                per_device[device.id] = per_device.get(device.id, 0) + size * leaf.dtype.itemsize
            continue
        for shard in getattr(leaf, "addressable_shards", ()):
            key = shard.device.id
            per_device[key] = per_device.get(key, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


# -- the schedule: what each asynchronous collective runs behind --------------------

_ASYNC_START = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.+?\s+"
    r"(?P<kind>" + "|".join(_COLLECTIVES) + r")-start\((?P<args>.*)$"
)
_DONE = re.compile(r"\s(?P<kind>" + "|".join(_COLLECTIVES) + r")-done\(%(?P<start>[\w.\-]+)\)")
_SYNC_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*.+?\s+(?P<kind>" + "|".join(_COLLECTIVES) + r")\("
)
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=")
_OP_NAME = re.compile(r'op_name="(?P<op>[^"]*)"')
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
    entry, bodies = _computations(hlo_text)
    runs = _runs_per_computation(entry, bodies)
    gemm: dict[str, bool] = {}

    def has_gemm(name: str) -> bool:
        if name not in gemm:
            gemm[name] = False  # no recursion through a cycle
            gemm[name] = any(_line_has_gemm(line) for line in bodies.get(name, []))
        return gemm[name]

    def _line_has_gemm(line: str) -> bool:
        return bool(_GEMM.search(line)) or any(has_gemm(c) for c in _callees(line))

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
                        done_name = _NAME.match(later).group("name")
                        break
                    named = _NAME.match(later)
                    if not sync and named and named.group("name") in graph.gemms:
                        behind.append(_op(later) or named.group("name"))
                found.append(
                    Scheduled(
                        name,
                        start.group("kind"),
                        runs.get(comp, 1),
                        not sync,
                        tuple(behind),
                        _op(line),
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
                        _op(line),
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
            m = _NAME.match(line)
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


def _op(line: str) -> str:
    """An instruction's op name (what the program was doing), or ''."""
    op = _OP_NAME.search(line)
    return op.group("op") if op else ""


def _callees(line: str) -> list[str]:
    names = _CALLED.findall(line)
    b = _BRANCHES.search(line)
    if b:
        names += re.findall(r"%([\w.\-]+)", b.group("names"))
    return names


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
