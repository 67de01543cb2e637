"""Whether a unit's code mixes the rows of its batch: a reduction over the
batch axis that no collective combines over the devices.

Inside a unit each device runs the code on its own rows. A computation
that reduces over the rows (a batch norm written outside `nn.BatchNorm`
and `nnx.BatchNorm`, a mean-centering over the batch, an in-batch
contrastive term) then covers one device's rows only, and the step is not
one device's. `mixed_rows` finds such reductions in the unit's jaxpr: it
follows the batch axis from the inputs that hold rows through the
equations (elementwise, broadcasts, reshapes, transposes, matrix
products, nested calls and scans), marks a value computed by reducing,
scanning, sorting or contracting over that axis, and clears the mark when
a collective over the devices combines it (as `nnx.BatchNorm` does under
the engine). It reports the first marked value that reaches an output with
the batch axis, or the state every device must hold alike.

Where it cannot follow the axis (a gather, an unknown primitive) it stops
following it, and finds nothing there: it refuses no model by guess.
Cost: one walk over the unit's jaxpr per trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.extend.core import Literal

from zpp_jax._compat import scan_carry
from zpp_jax.errors import UsageError

_REDUCTIONS = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_COMBINING = {"psum", "pmax", "pmin", "all_gather", "psum_scatter", "reduce_scatter", "pbroadcast"}
_SUB_JAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass(frozen=True)
class Mixed:
    """A value that mixes rows: the primitive that made it and its name
    stack (the modules it ran in)."""

    primitive: str
    where: str


@dataclasses.dataclass(frozen=True)
class _Fact:
    batch: int | None = None  # the batch axis's position, if followed
    mixed: Mixed | None = None


def mixed_rows(jaxpr, rows: Sequence[bool], axes: Sequence[str]) -> list[Mixed | None]:
    """For each output of `jaxpr` (a `ClosedJaxpr` of a unit's code on one
    device), the reduction over the rows that reaches it uncombined, or
    None. `rows`: whether each input holds rows (its axis 0); `axes`: the
    mesh axes a combining collective runs over."""
    facts = [_Fact(0 if r else None) for r in rows]
    return [f.mixed for f in _walk(jaxpr.jaxpr, facts, frozenset(axes))]


def _walk(jaxpr, inputs: list[_Fact], axes: frozenset) -> list[_Fact]:
    env = dict(zip(jaxpr.invars, inputs, strict=True))

    def read(v) -> _Fact:
        return _Fact() if isinstance(v, Literal) else env.get(v, _Fact())

    for eqn in jaxpr.eqns:
        facts = [read(v) for v in eqn.invars]
        outs = _equation(eqn, facts, axes)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn, facts: list[_Fact], axes: frozenset) -> list[_Fact]:
    name, params = eqn.primitive.name, eqn.params
    mixed = next((f.mixed for f in facts if f.mixed), None)
    batch = next((f.batch for f in facts if f.batch is not None), None)
    n_out = len(eqn.outvars)
    if name in _COMBINING and axes & set(_names(params)):
        return [_Fact(batch if name != "all_gather" else None)] * n_out
    sub = next((params[k] for k in _SUB_JAXPRS if k in params), None)
    if name == "scan":
        return _scan(eqn, facts, axes)
    if sub is not None and name not in ("while", "cond"):
        inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        if len(inner.invars) == len(facts):
            return _walk(inner, facts, axes)
    if batch is None:
        return [_Fact(None, mixed)] * n_out
    here = _origin(eqn)
    if name in _REDUCTIONS:
        reduced = tuple(params.get("axes", ()))
        if batch in reduced:
            return [_Fact(None, mixed or here)] * n_out
        return [_Fact(batch - sum(a < batch for a in reduced), mixed)] * n_out
    if name in _CUMULATIVE or name == "sort":
        axis = params.get("axis", params.get("dimension"))
        return [_Fact(batch, mixed or (here if axis == batch else None))] * n_out
    if name == "dot_general":
        return [_dot(eqn, facts, here, mixed)]
    return [_Fact(_moved(eqn, batch, facts, v.aval), mixed) for v in eqn.outvars]


def _origin(eqn) -> Mixed:
    stack = getattr(eqn.source_info, "name_stack", "")
    return Mixed(eqn.primitive.name, str(stack) or "the unit's code")


def _names(params) -> tuple:
    names = params.get("axes", params.get("axis_name", ()))
    return names if isinstance(names, tuple) else (names,)


def _dot(eqn, facts: list[_Fact], here: Mixed, mixed) -> _Fact:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = facts[0], facts[1]
    n_lhs = len(eqn.invars[0].aval.shape)
    if lhs.batch is not None:
        p = lhs.batch
        if p in lc:
            return _Fact(None, mixed or here)
        if p in lb:
            return _Fact(list(lb).index(p), mixed)
        free = [d for d in range(n_lhs) if d not in lc and d not in lb]
        return _Fact(len(lb) + free.index(p), mixed)
    q, n_rhs = rhs.batch, len(eqn.invars[1].aval.shape)
    if q in rc:
        return _Fact(None, mixed or here)
    if q in rb:
        return _Fact(list(rb).index(q), mixed)
    lhs_free = n_lhs - len(lc) - len(lb)
    free = [d for d in range(n_rhs) if d not in rc and d not in rb]
    return _Fact(len(lb) + lhs_free + free.index(q), mixed)


def _moved(eqn, batch: int, facts: list[_Fact], out) -> int | None:
    """Where the batch axis lands in the equation's output `out`."""
    name, params = eqn.primitive.name, eqn.params
    shape_in = next(
        v.aval.shape for v, f in zip(eqn.invars, facts, strict=True) if f.batch == batch
    )
    if name == "transpose":
        return list(params["permutation"]).index(batch)
    if name == "broadcast_in_dim":
        return params["broadcast_dimensions"][batch]
    if name == "reshape":
        before = math.prod(shape_in[:batch])
        prefix = 1
        for q, size in enumerate(out.shape):
            if prefix == before and size % shape_in[batch] == 0:
                return q
            prefix *= size
        return None
    if name == "squeeze":
        dims = params["dimensions"]
        return None if batch in dims else batch - sum(d < batch for d in dims)
    if name == "conv_general_dilated":
        spec = params["dimension_numbers"]
        return spec.out_spec[0] if batch == spec.lhs_spec[0] else None
    # Elementwise and shape-keeping equations: the axis stays where it was,
    # if the output has it.
    if len(getattr(out, "shape", ())) != len(shape_in):
        return None
    return batch if out.shape[batch] == shape_in[batch] else None


def _scan(eqn, facts: list[_Fact], axes: frozenset) -> list[_Fact]:
    """A scan's body once: its carries keep their axis; the scanned inputs
    lose their leading one inside; a scan over the rows themselves (the
    batch axis first in a scanned input) mixes them."""
    params = eqn.params
    scanned, carries = scan_carry(eqn)
    inside = list(facts[:scanned])
    for f in facts[scanned:]:
        if f.batch == 0:
            return [_Fact(None, f.mixed or _origin(eqn))] * len(eqn.outvars)
        inside.append(_Fact(None if f.batch is None else f.batch - 1, f.mixed))
    body = params["jaxpr"]
    outs = _walk(body.jaxpr, inside, axes)
    ys = [_Fact(None if f.batch is None else f.batch + 1, f.mixed) for f in outs[carries:]]
    return outs[:carries] + ys


def check_rows(unit: str, probe, inputs: tuple, rows: tuple, local_batch, kinds, axes) -> None:
    """Raise UsageError if unit `unit`'s code, ``probe(*inputs) -> (outputs,
    new state)`` on one device, mixes its rows into an output with the
    batch axis (`local_batch` rows) or into state every device must hold
    alike (`kinds`: each new state value's kind, "state" for those).
    `rows`: `inputs`' structure, True where an input holds rows."""
    if not any(jax.tree.leaves(rows)):
        return  # no input holds rows: nothing can mix them, and no second trace
    closed = jax.make_jaxpr(probe)(*inputs)
    found = mixed_rows(closed, jax.tree.leaves(rows), axes)
    outputs = closed.out_avals[: len(closed.out_avals) - len(kinds)]
    per_row = [bool(local_batch) and x.shape[:1] == (local_batch,) for x in outputs]
    alike = [kind == "state" for kind in kinds]
    for mixed, checked in zip(found, per_row + alike, strict=True):
        if mixed is not None and checked:
            raise UsageError(
                f"unit {unit} reduces over the rows of its batch ({mixed.primitive} in "
                f"{mixed.where}) without combining the result over the devices: on each "
                "device it covers that device's rows only, so the step would not be one "
                "device's. Use nn.BatchNorm or nnx.BatchNorm (their statistics are averaged "
                "over the devices), or give the model batch_axis_name= and average with "
                "lax.pmean over it, or compute it outside the unit"
            )
