"""Reading compiled HLO text: its collectives and the bytes they move.

`collectives_in_hlo` lists every collective of an HLO text (kind, dtypes,
bytes, replica groups, runs per step with loop trip counts); `summarize`
totals the bytes a device moves per step by the ring model, across and
inside nodes. Works on programs compiled for any target, CPU or GPU.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
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
    r"(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\("
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
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=")
_OP_NAME = re.compile(r'op_name="(?P<op>[^"]*)"')


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
        m, s = INSTRUCTION.match(line), _SCHEDULING_NAME.search(line)
        if m and s and s.group("name") != m.group("name"):
            out[m.group("name")] = s.group("name")
    return out


def collectives_in_hlo(hlo_text: str) -> list[Collective]:
    """Every collective instruction in compiled HLO text, in text order.

    `runs` is how many times it executes per call of the entry computation:
    loop trip counts (XLA's known_trip_count) multiplied through nested loops.
    A loop whose trip count XLA does not know counts once.
    """
    entry, bodies = computations(hlo_text)
    runs = runs_per_computation(entry, bodies)
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


def computations(hlo_text: str) -> tuple[str | None, dict[str | None, list[str]]]:
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


def runs_per_computation(
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
            for called in callees(line):
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


def has_loop(hlo_text: str) -> bool:
    """Whether the program runs a loop (a ``while`` instruction)."""
    return _WHILE.search(hlo_text) is not None


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


def op_name(line: str) -> str:
    """An instruction's op name (what the program was doing), or ''."""
    op = _OP_NAME.search(line)
    return op.group("op") if op else ""


def callees(line: str) -> list[str]:
    names = _CALLED.findall(line)
    b = _BRANCHES.search(line)
    if b:
        names += re.findall(r"%([\w.\-]+)", b.group("names"))
    return names
