"""What a compiled program communicates: collectives read from its HLO text."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>" + "|".join(_COLLECTIVES) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(?P<body>(?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)


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

    def spans_nodes(self, local_size: int) -> bool:
        """Whether any group holds devices of two nodes (node = id // local_size)."""
        return any(len({d // local_size for d in g}) > 1 for g in self.groups)

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 0


def collectives_in_hlo(hlo_text: str) -> list[Collective]:
    """Every collective instruction in compiled HLO text, in text order.

    A collective inside a loop body appears once here however many times it
    runs.
    """
    found = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        arrays = _ARRAY.findall(m.group("shape"))
        dtypes = tuple(dt for dt, _ in arrays)
        nbytes = sum(
            math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt] for dt, dims in arrays
        )
        found.append(
            Collective(m.group("name"), m.group("kind"), dtypes, int(nbytes), _groups(line))
        )
    return found


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
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
    m = re.search(r"source_target_pairs=\{(?P<body>[^}]*(?:\}[^}]*)*?)\}\s*(?:,|$)", line)
    if m:
        return tuple(
            tuple(int(i) for i in p.split(","))
            for p in re.findall(r"\{(\d+,\d+)\}", m.group("body"))
        )
    return ()
