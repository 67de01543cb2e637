"""One call of a unit: its parameters gathered, its code run on this
device's rows of the batch, its weight gradient reduced.

The framework-neutral part of `zpp_jax.shard` (NNX) and
`zpp_jax.shard_linen` (Linen). A call runs in global view (ordinary
`jax.jit` code on sharded arrays) and enters one `jax.shard_map` over
(`node`, `local`); inside it a `ShardedLayer` with a `ParamLayout` gathers
the unit's weights (qwZ, hpZ) and, in the backward pass, re-gathers them and
reduces the weight gradient (qgZ) to the parameters' own blocks. The loss is
over the global batch, so the reduction sums the devices' gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zpp_jax import collectives
from zpp_jax._compat import is_tracer
from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.frozen import FrozenSpec, frozen_layout, frozen_wire
from zpp_jax.layer import ShardedLayer
from zpp_jax.mesh import AXES, data_size, mesh_shape, model_size, place, spec_along
from zpp_jax.on_device import (
    check_not_nested,
    constraints_on_device,
    fold_keys,
    refused_inside,
    with_batch_axis,
)
from zpp_jax.outputs import combine_named, combine_outputs
from zpp_jax.overlap import prefetches
from zpp_jax.overlap.relay import current_chains
from zpp_jax.partition import ParamLayout, call_layout
from zpp_jax.pytrees import (
    changed_statics,
    close_tree,
    describe,
    open_call,
    open_tree,
    static_leaves,
    with_values,
    write_back,
)
from zpp_jax.rows import check_rows
from zpp_jax.tensor import model_split, packed, rank_params


@dataclasses.dataclass(frozen=True)
class UnitInfo:
    """What a unit's calls need, kept with the unit as static data."""

    mesh: Mesh
    config: ZeroPPConfig
    compute_dtype: Any
    dims: tuple[tuple[Any, int | None, int], ...]  # (key, split dimension, ndim) as stored
    stacked: bool = False  # a stack of layers, called inside a layer loop
    name: str = "<unit>"  # its path in the model, for messages and `outputs`
    outputs: Any = None  # how outputs that are not per-example combine (`combine_outputs`)
    frozen: tuple[FrozenSpec, ...] = ()  # split frozen parameters, stored as codes
    batch_axis_name: str | None = None  # the model's own name for the data-parallel devices
    model_dims: tuple[tuple[Any, int | None], ...] = ()  # (key, dimension split over `model`)
    constraint_axes: tuple[tuple[str, str | None], ...] = ()  # `on_device.constraint_axes`


def unit_scope(name: str) -> str:
    """The `jax.named_scope` a unit's call runs under, so that the compiled
    program's op names say which unit each collective belongs to (read back
    by `zpp_jax.analysis.report.unit_of`)."""
    return f"zpp_unit[{name}]"


# The unit calls of the current `expect_units` block (None outside one).
_UNIT_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "zpp_unit_calls", default=None
)


@contextlib.contextmanager
def expect_units(what: str, enabled: bool = True) -> Iterator[None]:
    """Raise UsageError if the block calls no unit (unless not `enabled`).
    A sharded model whose call traces no unit runs with none of the engine
    (nothing sharded, quantized or reduced), as when a cached trace of the
    model from before it was sharded is reused."""
    calls: list[str] = []
    token = _UNIT_CALLS.set(calls)
    try:
        yield
    finally:
        _UNIT_CALLS.reset(token)
    if enabled and not calls:
        raise UsageError(
            f"{what} called none of the model's units: a trace of the model made before it was "
            "sharded (or with another config) was reused, so the engine would not run. Build "
            "the jitted function after sharding; a jitted method of the model's own (nn.jit) "
            "is traced anew by zpp"
        )


def unit_infos(tree) -> list[UnitInfo]:
    """The `UnitInfo` of every unit of the sharded NNX modules in `tree`."""
    infos = []
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Module)):
        if isinstance(leaf, nnx.Module):
            for _, m in nnx.iter_modules(leaf):
                if isinstance(getattr(m, "_zpp", None), UnitInfo):
                    infos.append(m._zpp)
    return infos


def check_units(units: Sequence[tuple], fix: str) -> None:
    """Raise UsageError unless `units` (module paths) is non-empty and no
    unit contains another; `fix` says how to write the policy."""
    if not units:
        raise UsageError(f"the policy selected no unit with parameters; {fix}")
    for a in units:
        for b in units:
            if a != b and b[: len(a)] == a:
                raise UsageError(
                    f"units overlap: {_name(a)} contains {_name(b)}; a unit's weights are "
                    "gathered for its whole call, so units must be disjoint submodules"
                )


def _name(path: tuple) -> str:
    return "/".join(str(k) for k in path) or "<the model>"


def residual_size(config: ZeroPPConfig, params: Sequence[tuple], mesh_sizes) -> int:
    """Elements of one call's error-feedback residual over all devices."""
    nodes, local = mesh_sizes
    layout = call_layout(config, params, nodes * local)
    return nodes * local * collectives.residual_size(layout.shard_size, nodes, local)


def zero_residual(
    config: ZeroPPConfig,
    params: Sequence[tuple],
    mesh: Mesh,
    lead_shape: tuple = (),
    abstract: bool = False,
) -> jax.Array | jax.ShapeDtypeStruct:
    """A unit's zero error-feedback residual: `residual_size` elements of
    `config.residual_dtype`, split over every device (after `lead_shape`,
    a stack's layer axis); with `abstract`, its shape, dtype and sharding."""
    shape = lead_shape + (residual_size(config, params, mesh_shape(mesh)),)
    dtype = jnp.dtype(config.residual_dtype)
    zeros = jax.ShapeDtypeStruct(shape, dtype) if abstract else jnp.zeros(shape, dtype)
    return place(zeros, mesh, len(lead_shape))


Run = Callable[[dict, list, tuple, dict], tuple[Any, list, dict]]


def run_unit(
    info: UnitInfo,
    params: Sequence[tuple[Any, jax.Array, int | None, int]],
    state: Sequence[tuple[jax.Array, str]],
    residual: jax.Array | None,
    args: tuple,
    kwargs: dict,
    run: Run,
    frozen: tuple = (None, ()),
) -> tuple[Any, list, dict]:
    """Call a unit through the engine, in global view.

    Args:
      params: (key, value, split dimension as stored, ndim as stored) per
        parameter. Inside `nnx.scan` / `nnx.vmap` a value arrives without its
        leading stacking axes, and its split dimension moves down with them.
      state: (value, kind) per other state array of the unit. Kind "key": a
        random key, folded with the device index inside the call and
        returned as it came in. Kind "cache": a decoding cache, split with
        the batch when its leading axis is the batch's. Kind "state":
        whole on every device, and it must come out the same on every
        device (batch statistics averaged over the devices, counters).
      residual: the unit's error-feedback residual (with error feedback).
      frozen: (the unit's stored frozen wire or None, (key, value) of each
        frozen parameter kept whole): frozen weights, which get no gradient
        (see `zpp_jax.frozen`).
      run: ``run(params by key, state values, args, kwargs) -> (outputs, new
        state values, sown values)``: the unit's own code, on one device;
        sown values (``sow``, `nnx.Intermediate`) by name.

    Returns the outputs, the new state values and the sown values, each
    output and sown value combined over the devices by `combine_outputs`.
    """
    check_not_nested(info.name, info.mesh)
    calls = _UNIT_CALLS.get()
    if calls is not None:
        calls.append(info.name)
    call = _Call(info, params, state, residual, args, kwargs, frozen)
    prefetch = prefetches(info.mesh)
    # Called outside any trace (an eager call of the model): the call is
    # compiled on its own, and joins no relay chain.
    eager = not any(is_tracer(x) for x in [v for _, v, _, _ in params] + jax.tree.leaves(args))
    # A unit of vectors only (a final norm) has no matrix multiply of its
    # own weights: its backward pass would be an empty window for the
    # neighbours' communication, so it is left out of the relay chain and
    # its own few bytes are scheduled freely.
    relayed = (call.layout is not None and any(np.ndim(v) >= 2 for _, v, _, _ in params)) or any(
        len(s.shape) >= 2 for s in info.frozen
    )
    # With a `model` axis the call is manual over the data axes only and XLA
    # partitions its code along `model` (`zpp_jax.tensor`); the token is
    # each data device's, the same on its model ranks.
    tensor_parallel = model_size(info.mesh) > 1
    chains = current_chains() if prefetch and relayed and not eager else None
    token = None if chains is None else chains.take(info.mesh, data_size(info.mesh))
    manual = {"axis_names": set(AXES)} if tensor_parallel else {}
    mapped = jax.shard_map(
        call.local(run, prefetch),
        mesh=info.mesh,
        in_specs=call.in_specs(token),
        out_specs=call.out_specs(token),
        check_vma=False,
        **manual,
    )
    # The layer's custom_vjp cannot run under an eager shard_map: compile it.
    with refused_inside(info.name):
        (stacked, new_state, new_args), token = (jax.jit(mapped) if eager else mapped)(
            *call.operands(token)
        )
    if token is not None:
        chains.put(info.mesh, token)
    call.update_args(new_args)
    out, sown = combine_outputs(info, stacked[:2], call.local_batch)
    call.write_back(combine_named(info, stacked[2], call.local_batch))
    return close_tree(out), new_state, sown


class _Call:
    """One call of a unit taken apart: its parameters split over the
    devices or whole, their layout, its state, and its arguments, per row
    of the batch or whole."""

    def __init__(self, info: UnitInfo, params, state, residual, args: tuple, kwargs: dict, frozen):
        self.info, self.state, self.args, self.kwargs = info, state, args, kwargs
        n = data_size(info.mesh)
        self.split, self.whole = _split_params(params)
        self.model_split = model_split(model_size(info.mesh), info.model_dims, params, self.split)
        self.stored, frozen_whole = frozen
        self.frozen_keys = {key for key, _ in frozen_whole}
        self.whole = self.whole + list(frozen_whole)
        self.frozen_layout = frozen_layout(info.config, info.frozen, n) if info.frozen else None
        self.layout = None
        if self.split:
            self.layout = call_layout(info.config, rank_params(self.split, self.model_split), n)
            _check_residual(info, self.layout, residual)
        else:
            residual = None
        self.residual = residual
        # Dataclasses opened into their fields; NNX keeps non-array leaves static.
        self.opened = open_call(args, kwargs, info.name)
        self.arg_def, arg_state = nnx.split(self.opened)
        self.arg_items = nnx.to_flat_state(arg_state)
        self.written: list[tuple] = []  # paths the code wrote into, found when traced
        self.statics = static_leaves((args, kwargs))
        self.batch = _batch_size(self.arg_items)
        if self.batch is not None and self.batch % n:
            raise UsageError(
                f"unit {info.name} got a batch of {self.batch} rows, which does not split over "
                f"the {n} devices; use a global batch that is a multiple of {n}"
            )
        self.local_batch = None if self.batch is None else self.batch // n
        self.kinds = [kind for _, kind in state]
        self.keys = [kind == "key" for _, kind in state]
        self.per_row = [kind == "cache" and self._is_rows(v) for v, kind in state]
        self.arg_keys = [isinstance(v, nnx.RngKey) for _, v in self.arg_items]

    def _check_rows(self, run: Run, inputs: tuple) -> None:
        """Refuse code that reduces over this device's rows uncombined
        (`zpp_jax.rows.check_rows`): a second trace of the unit's code."""

        def probe(values, state_values, arg_values):
            call = close_tree(nnx.merge(self.arg_def, with_values(self.arg_items, arg_values)))
            out, new_state, _ = run(values, state_values, *call)
            arrays = [x for x in jax.tree.leaves(out) if hasattr(x, "shape")]
            return arrays, new_state

        values, _, _ = inputs
        rows = (
            {k: False for k in values},
            list(self.per_row),
            [self._is_rows(v) for _, v in self.arg_items],
        )
        # A model's own batch axis name is bound to the devices as well.
        axes = (*self.info.mesh.axis_names, self.info.batch_axis_name)
        check_rows(self.info.name, probe, inputs, rows, self.local_batch, self.kinds, axes)

    def _is_rows(self, x) -> bool:
        """Whether `x` holds one row per example of the batch."""
        return self.batch is not None and np.ndim(x) >= 1 and np.shape(x)[0] == self.batch

    def on_device(self, run: Run) -> Callable:
        """The unit's code on this device's rows: ``f(full params, (whole
        params, state, arguments)) -> (outputs and sown values with a
        leading device axis, new state, new arguments)``."""
        info, arg_keys, keys = self.info, self.arg_keys, self.keys

        def fn(full, inputs):
            rep, state_values, arg_values = inputs
            index = lax.axis_index(AXES)
            trainable, frozen = full if self.frozen_layout is not None else (full, None)
            values = dict(zip([k for k, _, _ in self.split], trainable or [], strict=True))
            values.update(zip([s.path for s in info.frozen], frozen or [], strict=True))
            for (key, _), value in zip(self.whole, rep, strict=True):
                values[key] = lax.stop_gradient(value) if key in self.frozen_keys else value
            if info.compute_dtype is not None:
                values = {k: v.astype(info.compute_dtype) for k, v in values.items()}
            given = fold_keys(arg_values, arg_keys, index)
            folded = fold_keys(state_values, keys, index)
            with constraints_on_device(info):
                self._check_rows(run, (values, folded, given))
            call_args, call_kwargs = close_tree(
                nnx.merge(self.arg_def, with_values(self.arg_items, given))
            )
            with constraints_on_device(info):
                out, new_state, sown = run(values, folded, call_args, call_kwargs)
            out = open_tree(out, f"unit {info.name}'s output", statics=True)
            if len(new_state) != len(state_values):
                raise UsageError(
                    f"unit {info.name} made new state in its call ({len(state_values)} "
                    f"variables before, {len(new_state)} after); create a unit's variables "
                    "(caches, counters) before sharding it, e.g. init_cache before zpp.shard"
                )
            after = open_call(call_args, call_kwargs, info.name)
            new_items = dict(nnx.to_flat_state(nnx.split(after)[1]))
            new_args = [
                old
                if is_key or not isinstance(new_items.get(p), nnx.Variable)
                else new_items[p].get_value()
                for (p, _), old, is_key in zip(self.arg_items, arg_values, arg_keys, strict=True)
            ]
            written = self._writes(after, new_items, given)
            new_state = [
                old if is_key else new
                for new, old, is_key in zip(new_state, state_values, keys, strict=True)
            ]
            stacked = jax.tree.map(lambda a: a[None], (out, sown, written))
            return stacked, new_state, new_args

        return fn

    def _writes(self, after, new_items: dict, given: list) -> dict:
        """What the unit's code wrote into the containers passed to it (a
        new key or item, or another array at a path), by `describe` name;
        their paths are kept for `write_back`."""
        changed = changed_statics(self.statics, static_leaves(after))
        if changed:
            raise UsageError(
                f"unit {self.info.name} wrote a value that is not an array into its arguments "
                f"(at {changed[0]} of (args, kwargs)); only arrays are carried back to the "
                "caller: return the value from the unit instead"
            )
        given_at = {p: x for (p, _), x in zip(self.arg_items, given, strict=True)}
        written = {
            p: v
            for p, v in new_items.items()
            if not isinstance(v, nnx.Variable) and (p not in given_at or v is not given_at[p])
        }
        self.written = list(written)
        return {describe(p): v for p, v in written.items()}

    def write_back(self, combined: dict) -> None:
        """Put what the unit's code wrote into its arguments, combined over
        the devices, into the caller's own containers."""
        if self.written:
            values = {p: combined[describe(p)] for p in self.written}
            write_back((self.args, self.kwargs), values, self.info.name)

    def local(self, run: Run, prefetch: bool) -> Callable:
        """What `jax.shard_map` runs on each device: the unit's code, through
        a `ShardedLayer` when it has parameters to gather."""
        fn, layout, config = self.on_device(run), self.layout, self.info.config
        fn = with_batch_axis(fn, self.info.batch_axis_name, data_size(self.info.mesh))
        split = self.model_split
        frozen = None if self.frozen_layout is None else frozen_wire(config, self.frozen_layout)

        def leaves(full):
            if frozen is None:
                return jax.tree.leaves(full)
            return tuple(None if part is None else jax.tree.leaves(part) for part in full)

        def local(blocks, rep, state_values, arg_values, residual, token, stored):
            inputs = (rep, state_values, arg_values)
            if layout is None and frozen is None:
                return fn(None, inputs), None
            # Decoded straight into the compute dtype: the dequantization
            # writes bf16 weights, not fp32 ones that a cast then copies, and
            # their gradients reach the reduction in bf16 (the same values).
            layer = ShardedLayer(
                lambda full, x: fn(leaves(full), x),
                layout,
                config,
                compute_dtype=self.info.compute_dtype,
                reduction="sum",
                prefetch=prefetch,
                frozen=frozen,
                model_split=split,
            )
            shard = None if layout is None else packed(layout, split, blocks)
            if frozen is not None:
                return layer.with_frozen(shard, stored, inputs, residual, token)
            if token is None:
                return layer(shard, inputs, residual), None
            return layer.relayed(shard, inputs, residual, token)

        return local

    def _state_specs(self) -> list[P]:
        return [P(AXES) if rows else P() for rows in self.per_row]

    def in_specs(self, token) -> tuple:
        return (
            [spec_along(np.ndim(v), d) for _, v, d in self.split],
            P(),
            self._state_specs(),
            [
                P(AXES) if self._is_rows(x) and not isinstance(x, nnx.Variable) else P()
                for _, x in self.arg_items
            ],
            None if self.residual is None else P(AXES),
            None if token is None else P(AXES),
            None if self.stored is None else P(AXES),
        )

    def out_specs(self, token) -> tuple:
        return (P(AXES), self._state_specs(), P()), None if token is None else P(AXES)

    def operands(self, token) -> tuple:
        return (
            [v for _, v, _ in self.split],
            [v for _, v in self.whole],
            [v for v, _ in self.state],
            [x.get_value() if isinstance(x, nnx.Variable) else x for _, x in self.arg_items],
            self.residual,
            token,
            self.stored,
        )

    def update_args(self, new_args: list) -> None:
        """Write the new state of the graph nodes passed in (random streams)
        back into the caller's arguments."""
        changed = [
            (item, x)
            for item, x in zip(self.arg_items, new_args, strict=True)
            if isinstance(item[1], nnx.Variable)
        ]
        if changed:
            items, values = zip(*changed, strict=True)
            nnx.update(self.opened, with_values(items, values))  # the caller's variables


def _split_params(params):
    """(split: (key, value, dimension in the value), whole: (key, value))."""
    split, whole = [], []
    for key, value, dim, ndim in params:
        lead = ndim - np.ndim(value)
        if dim is not None and dim >= lead:
            split.append((key, value, dim - lead))
        else:
            whole.append((key, value))
    return split, whole


def _check_residual(info: UnitInfo, layout: ParamLayout, residual) -> None:
    if not info.config.error_feedback:
        return
    n = data_size(info.mesh)
    need = (n * collectives.residual_size(layout.shard_size, *mesh_shape(info.mesh)),)
    if residual is None or np.shape(residual) != need:
        raise UsageError(
            f"unit {info.name}'s error-feedback residual has shape "
            f"{None if residual is None else np.shape(residual)}, a call of it needs "
            f"{need}: it is called with parameters of other shapes than zpp.shard "
            "stored (a stack it did not recognize?); pass a policy, or turn error "
            "feedback off"
        )


def _batch_size(items) -> int | None:
    """The leading dimension of the first array argument (not a variable)."""
    for _, x in items:
        if not isinstance(x, nnx.Variable) and np.ndim(x) >= 1:
            return int(np.shape(x)[0])
    return None
