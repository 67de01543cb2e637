"""`zpp_jax.shard_linen`: the same as `zpp_jax.shard`, for Flax Linen.

``model, variables = zpp.shard_linen(model, variables, mesh, config)``
returns the model wrapped so that its chosen submodules (units) run through
the engine, and the variables with every parameter split over (`node`,
`local`) in its own shape. The training loop keeps its shape: call
``model.apply(variables, x, rngs=..., mutable=["batch_stats"])`` as before
and take gradients with respect to ``variables["params"]`` (with error
feedback, also with respect to ``variables["zpp_residuals"]``: the next
step's residuals).

A unit is a submodule called as ``submodule(...)`` (its ``__call__``); its
calls are intercepted (`flax.linen.intercept_methods`) and run as in
`zpp_jax.unit.run_unit`. `nn.BatchNorm` inside a unit averages its
statistics over every device. Modules lifted by `nn.scan` are not split per
layer: make their parent, or another module, the unit.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax._compat import is_tracer
from zpp_jax.config import ZeroPPConfig, check_block_sizes
from zpp_jax.errors import UsageError, check_compute_dtype, check_policy
from zpp_jax.mesh import AXES, data_size, place, shard_dim
from zpp_jax.metadata import (
    SHARD_ALONG,
    Rules,
    box_model_dim,
    box_preference,
    check_model_axis,
    check_shard_along,
    is_box,
    reboxed,
    unboxed,
)
from zpp_jax.on_device import check_batch_axis_name, constraint_axes
from zpp_jax.outputs import Outputs, append_sown, check_outputs
from zpp_jax.overlap.relay import relay_scope
from zpp_jax.partition import quant_float_dtypes
from zpp_jax.unit import (
    UnitInfo,
    check_units,
    expect_units,
    run_unit,
    zero_residual,
)

_ON_DEVICE = contextvars.ContextVar("zpp_linen_on_device", default=False)
_LAYER_NAME = re.compile(r"^(.*)_(\d+)$")


def default_linen_units(params: dict) -> list[tuple[str, ...]]:
    """Units chosen from the parameter tree, as `zpp.lowlevel.default_units` does for
    NNX. A list of layers is two or more children named ``<name>_<i>`` with
    one prefix, each holding submodules of its own (as a Python list of
    blocks is named; ``Dense_0``, ``Dense_1`` of one block are not layers).
    Descending from the root through modules that hold such a list, every
    layer of it is a unit, and so is every other child with parameters.
    Parameters held directly by the modules passed through are split too,
    and gathered by XLA where they are used."""
    units = []

    def children(tree):
        return [k for k, v in tree.items() if isinstance(v, dict)]

    def layers(tree):
        """Names of the children that are layers of a list."""
        groups: dict[str, list[str]] = {}
        for k in children(tree):
            m = _LAYER_NAME.match(k)
            if m and children(tree[k]):
                groups.setdefault(m.group(1), []).append(k)
        return {k for names in groups.values() if len(names) >= 2 for k in names}

    def has_layers(tree):
        return bool(layers(tree)) or any(has_layers(tree[k]) for k in children(tree))

    def visit(path, tree, top):
        if not top and not has_layers(tree):
            units.append(path)
            return
        listed = layers(tree)
        for k in children(tree):
            if k in listed:
                units.append(path + (k,))
            else:
                visit(path + (k,), tree[k], False)

    visit((), params, True)
    return units


RESIDUALS = "zpp_residuals"


def _zero_residuals(params: dict, infos: dict[tuple, UnitInfo], mesh: Mesh) -> dict:
    """One zero error-feedback residual per unit, split over the devices."""
    out = {}
    for unit, info in infos.items():
        split = [
            (np.shape(params[unit + key]), jnp.result_type(params[unit + key]), dim)
            for key, dim, _ in info.dims
            if dim is not None
        ]
        if split:
            out[unit + ("residual",)] = zero_residual(info.config, split, mesh)
    return unflatten_dict(out)


class ShardedLinen:
    """A Linen module whose units run through the engine. ``apply`` is the
    module's own; everything else is delegated to the module."""

    def __init__(self, module: nn.Module, units: dict[tuple, UnitInfo]) -> None:
        self.module = module
        self.units = units

    def apply(self, variables, *args, **kwargs):
        """The module's ``apply``, its units through the engine. Jitted
        methods of the module's own (``nn.jit``) are traced inline, anew
        each time, so that the units take effect in every trace instead of
        a cached one from before sharding. An eager call is compiled as a
        whole (the units cannot run under an eager ``shard_map``).

        Raises:
          UsageError: the module's ``__call__`` called no unit.
        """
        leaves, tree = jax.tree.flatten((variables, args, kwargs))
        if any(is_tracer(x) for x in leaves):
            return self._apply(variables, args, kwargs)
        arrays = [isinstance(x, jax.Array | np.ndarray) for x in leaves]

        def traced(values):
            it = iter(values)
            full = [next(it) if a else x for x, a in zip(leaves, arrays, strict=True)]
            return self._apply(*jax.tree.unflatten(tree, full))

        return jax.jit(traced)([x for x, a in zip(leaves, arrays, strict=True) if a])

    def _apply(self, variables, args, kwargs):
        whole = kwargs.get("method") in (None, "__call__")  # another method may use no unit
        if "params" in variables:  # zpp places the parameters: no box constrains them
            params = jax.tree.map(unboxed, variables["params"], is_leaf=is_box)
            variables = {**variables, "params": params}
        with (
            expect_units("the model's __call__", whole),
            relay_scope(),
            nn.intercept_methods(self._intercept),
            jax.disable_jit(),
        ):
            return self.module.apply(variables, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)

    def _intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if _ON_DEVICE.get():  # inside a unit: its own interceptor applies
            return next_fun(*args, **kwargs)
        info = self.units.get(tuple(module.path))
        if info is None or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        return _call_unit(module, info, args, kwargs)


def _call_unit(module: nn.Module, info: UnitInfo, args, kwargs):
    variables = module.variables
    params = {p: unboxed(v) for p, v in flatten_dict(dict(variables.get("params", {}))).items()}
    others = {
        c: flatten_dict(dict(t)) for c, t in variables.items() if c not in ("params", RESIDUALS)
    }
    residual = None
    if info.config.error_feedback:
        residual = dict(variables.get(RESIDUALS, {})).get("residual")
        if residual is None:
            raise UsageError(
                f"unit {info.name} has no error-feedback residual: pass the "
                f"{RESIDUALS!r} collection that shard_linen returned to apply, and take its "
                "gradient (the next step's residuals)"
            )
    rng_names = sorted(module.scope.rngs) if module.scope.rngs else []
    rng_keys = [module.make_rng(r) for r in rng_names]
    # Tuples in a collection are what `sow` made: each device's call sows
    # into none, and what it sows is combined over the devices and appended.
    flat = [(c, p, v) for c, tree in others.items() for p, v in tree.items()]
    other_items = [(c, p, v) for c, p, v in flat if not isinstance(v, tuple)]
    sown_before = {(c, p): v for c, p, v in flat if isinstance(v, tuple)}
    stored = {key: (dim, ndim) for key, dim, ndim in info.dims}
    unbound = module.clone(parent=None)
    mutable = _mutable(module, others)
    sown_at: dict[str, tuple] = {}  # what the call sowed: name -> (collection, path)

    def run(values, state_values, call_args, call_kwargs):
        tree = {"params": unflatten_dict(values)}
        for (c, p, _), v in zip(other_items, state_values, strict=False):
            tree.setdefault(c, {})[p] = v
        tree = {c: unflatten_dict(t) if c != "params" else t for c, t in tree.items()}
        rngs = dict(zip(rng_names, state_values[len(other_items) :], strict=True))
        # Set here, not around the caller's apply: the backward pass runs this
        # again, long after that apply has returned.
        token = _ON_DEVICE.set(True)
        try:
            with nn.intercept_methods(_on_device):
                out, updates = unbound.apply(
                    tree, *call_args, rngs=rngs, mutable=mutable, **call_kwargs
                )
        finally:
            _ON_DEVICE.reset(token)
        flat_updates = {c: flatten_dict(dict(t)) for c, t in updates.items() if c != "params"}
        new = [
            flat_updates.get(c, {}).get(p, v)
            for (c, p, _), v in zip(other_items, state_values, strict=False)
        ]
        state_keys = {(c, p) for c, p, _ in other_items}
        sown = {}
        for c, items in flat_updates.items():
            for p, v in items.items():
                if (c, p) not in state_keys:
                    name = "/".join((c, *p))
                    sown_at[name], sown[name] = (c, p), v
        return out, new + list(state_values[len(other_items) :]), sown

    out, new_state, sown = run_unit(
        info,
        [(p, v, *stored[p]) for p, v in params.items()],
        [(v, _state_kind(c)) for c, _, v in other_items] + [(k, "key") for k in rng_keys],
        residual,
        args,
        kwargs,
        run,
    )
    final = {(c, p): v for (c, p, _), v in zip(other_items, new_state, strict=False)}
    final.update(sown_before)
    for name, value in sown.items():
        key = sown_at[name]
        final[key] = (
            append_sown(info, name, sown_before[key], value) if key in sown_before else value
        )
    _put_collections(module, final)
    return out


def _state_kind(collection: str) -> str:
    """How a unit treats a collection's variables (`run_unit`'s kinds): the
    autoregressive ``cache`` is split with the batch where its leading axis
    is the batch's, as `nnx.Cache` is; every other one is whole on every
    device and must come out the same on each."""
    return "cache" if collection == "cache" else "state"


def _mutable(module: nn.Module, others: dict):
    """The collections the caller's apply may change, new ones (a first sow)
    included; a filter (a DenyList) lets change the ones it names of those held."""
    mutable = module.scope.mutable
    if isinstance(mutable, list | tuple):
        return [c for c in mutable if c not in ("params", RESIDUALS)]
    if mutable is not True and not isinstance(mutable, str):
        return [c for c in others if module.is_mutable_collection(c)]
    return mutable


def _put_collections(module: nn.Module, final: dict) -> None:
    """Write a unit's new variables ((collection, path) -> value) into the
    caller's scope, in the collections it may change."""
    for c in {c for c, _ in final}:
        if not module.is_mutable_collection(c):
            continue
        tree = unflatten_dict({p: v for (col, p), v in final.items() if col == c})
        for name, value in tree.items():
            module.put_variable(c, name, value)


def _on_device(next_fun, args, kwargs, context):
    module = context.module
    batch_norm = isinstance(module, nn.BatchNorm) and module.axis_name is None
    if batch_norm and context.method_name == "__call__":
        return _global_batch_norm(module, args, kwargs)
    return next_fun(*args, **kwargs)


def _global_batch_norm(module: nn.BatchNorm, args, kwargs):
    """A BatchNorm inside a unit, with its statistics averaged over every
    device: those of the global batch."""
    bn = module.clone(parent=None, axis_name=AXES)
    mutable = ["batch_stats"] if module.is_mutable_collection("batch_stats") else False
    out = bn.apply(dict(module.variables), *args, mutable=mutable, **kwargs)
    if mutable:
        out, updates = out
        for name, value in updates["batch_stats"].items():
            module.put_variable("batch_stats", name, value)
    return out


def shard_linen(
    module: nn.Module,
    variables: dict,
    mesh: Mesh,
    config: ZeroPPConfig | None = None,
    policy: Callable[[tuple], bool] | Sequence[tuple] | None = None,
    compute_dtype: jax.typing.DTypeLike | None = None,
    *,
    outputs: Outputs = None,
    batch_axis_name: str | None = None,
    rules: Rules = None,
    shard_along: Sequence[str] = SHARD_ALONG,
) -> tuple[ShardedLinen, dict]:
    """Shard a Linen model for ZeRO++ over `mesh`.

    Returns ``(model, variables)``: `model.apply` runs the module with its
    units through the engine; `variables` holds every parameter split over
    the devices along its first dimension that the device count divides (or
    whole, if none does), and every other collection whole on every device.

    Args:
      variables: the module's variables (``module.init(...)``), with a
        ``"params"`` collection.
      policy: which submodules are units: a function of the module path
        (a tuple of names) or a sequence of paths. Default:
        `default_linen_units`.
      compute_dtype: cast each unit's gathered weights (mixed precision).
      outputs: how a unit's outputs that are not per example combine over
        the devices, as for `zpp_jax.shard.shard` (unit paths are joined
        with "/"; what a unit sows is named ``sow['<collection>/<path>']``).
      batch_axis_name: as for `zpp_jax.shard.shard`.
      rules: as for `zpp_jax.shard.shard`.
      shard_along: as for `zpp_jax.shard.shard`. Boxed parameters come back
        in their boxes; `unshard_linen` gives them whole.

    With ``config.error_feedback`` the variables also hold a ``"zpp_residuals"``
    collection (`RESIDUALS`): a zero residual per unit ((1 + 1/local) x its
    size per device). Pass it to `apply` and differentiate with respect to
    it too: that "gradient" is the next step's residuals (never optimize it).

    Raises:
      UsageError: no ``"params"``, a policy that selects no unit or
        overlapping units, a non-floating parameter.
    """
    config = ZeroPPConfig.check(config)
    check_outputs(outputs)
    check_batch_axis_name(batch_axis_name)
    _check_module(module, policy)
    dtype = check_compute_dtype(compute_dtype)
    boxed = _checked_params(variables, config)
    params = {path: unboxed(v) for path, v in boxed.items()}
    units = _select(params, policy)
    rules = rules if rules is not None else nn.get_logical_axis_rules()
    along = check_shard_along(shard_along)
    sharded, split_dims = _placed(boxed, mesh, config, rules, along)
    infos = {}
    for unit in units:
        inside = [p for p in params if p[: len(unit)] == unit]
        infos[unit] = UnitInfo(
            mesh,
            config,
            dtype,
            tuple((p[len(unit) :], split_dims[p][0], np.ndim(params[p])) for p in inside),
            name="/".join(unit),
            outputs=outputs,
            batch_axis_name=batch_axis_name,
            model_dims=tuple((p[len(unit) :], split_dims[p][1]) for p in inside),
            constraint_axes=constraint_axes(rules, along),
        )
    replicated = NamedSharding(mesh, P())
    out = {c: jax.device_put(dict(v), replicated) for c, v in variables.items() if c != "params"}
    out["params"] = unflatten_dict(sharded)
    if config.error_feedback:
        out[RESIDUALS] = _zero_residuals(params, infos, mesh)
    return ShardedLinen(module, infos), out


def _check_module(module, policy) -> None:
    """Raise UsageError unless `module` is a Linen module not yet sharded
    and `policy` has a policy's form."""
    if isinstance(module, ShardedLinen):
        raise UsageError(
            "this model is already sharded (zpp.shard_linen ran on it): use it as it is, or "
            "shard the original module"
        )
    if not isinstance(module, nn.Module):
        raise UsageError(
            f"zpp.shard_linen takes a Flax Linen module, got {type(module).__name__}; for NNX "
            "use zpp.shard"
        )
    check_policy(policy, "zpp.shard_linen")


def _checked_params(variables: dict, config: ZeroPPConfig) -> dict:
    """The ``"params"`` of `variables`, flat by path (boxed, if they were);
    raises UsageError unless there are some, all floating point, and
    `config`'s blocks fit them."""
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise UsageError(
            "shard_linen needs the model's variables with a 'params' collection (what "
            f"module.init returns), got {type(variables).__name__}"
            + (f" with {sorted(variables)}" if isinstance(variables, Mapping) else "")
        )
    boxed = flatten_dict(dict(variables["params"]))
    for path, value in boxed.items():
        dtype = jnp.dtype(jnp.result_type(unboxed(value)))
        if dtype not in quant_float_dtypes():
            raise UsageError(
                f"parameter {'/'.join(path)} has dtype {dtype.name}; "
                "ZeRO++ shards float32, bfloat16 and float16 parameters"
            )
    check_block_sizes(config, [int(np.size(unboxed(v))) for v in boxed.values()])
    return boxed


def _placed(boxed: dict, mesh: Mesh, config: ZeroPPConfig, rules, along) -> tuple[dict, dict]:
    """Each parameter of `boxed` (flat) stored split over the data-parallel
    devices and, with a `model` axis, along the dimension its names map to
    `model`, in its box if it had one; and per parameter the (data, model)
    dimensions it is split along."""
    n, keep = data_size(mesh), config.persistence_threshold
    tp = {p: box_model_dim(v, mesh, rules, "/".join(p)) for p, v in boxed.items()}
    refused = "error feedback" if config.error_feedback else None
    check_model_axis(list(tp.values()), mesh, refused)
    sharded, split_dims = {}, {}
    for path, value in boxed.items():
        raw, prefer = unboxed(value), box_preference(value, rules, along)
        dim = shard_dim(np.shape(raw), n, False, keep, prefer, taken=tp[path])
        sharded[path] = reboxed(value, place(raw, mesh, dim, tp[path]))
        split_dims[path] = dim, tp[path]
    return sharded, split_dims


def unshard_linen(model: ShardedLinen, variables: dict) -> tuple[nn.Module, dict]:
    """The module `shard_linen` wrapped, and a copy of `variables` with
    every parameter whole on every device, in its box if it had one (the
    author's names), and no error-feedback residuals: for evaluation,
    generation and export. The sharded variables are left as they are.

    Memory: the full model on every device.
    """
    if not isinstance(model, ShardedLinen):
        raise UsageError("zpp.unshard_linen takes the model zpp.shard_linen returned")
    mesh = next(iter(model.units.values())).mesh
    whole = NamedSharding(mesh, P())

    def gathered(value):
        return reboxed(value, jax.device_put(unboxed(value), whole))

    params = jax.tree.map(gathered, variables["params"], is_leaf=is_box)
    out = {c: v for c, v in variables.items() if c not in ("params", RESIDUALS)}
    return model.module, {**out, "params": params}


def _select(params: dict, policy) -> list[tuple]:
    """The unit paths `policy` selects among the modules holding `params`
    (flat, by path)."""
    if policy is None:
        units = default_linen_units(unflatten_dict(params))
    elif callable(policy):
        units = sorted({p[:i] for p in params for i in range(1, len(p)) if policy(p[:i])})
    else:
        units = [tuple(p) for p in policy]
    units = [u for u in units if any(p[: len(u)] == u for p in params)]
    check_units(
        units,
        "give shard_linen a policy that names submodule paths, or policy=None for the default",
    )
    return units


Policy = Any
