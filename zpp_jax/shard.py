"""`zpp_jax.shard`: any Flax NNX model, sharded per submodule.

``model = zpp.shard(model, mesh, config)`` picks *units* (submodules: each
layer of a list, a scanned stack, every other child with parameters; or the
ones a `policy` names), stores every parameter sharded over (`node`, `local`)
in its own shape and dtype, and makes each unit's ``__call__`` go through the
engine: gather the unit's weights (qwZ, hpZ), run the unit's own code on this
device's part of the batch, and in the backward pass re-gather and reduce the
weight gradient (qgZ). Everything else (the model's own ``__call__``, the
loss, parameters used outside a unit call, tied weights) runs as ordinary
`jax.jit` code on sharded global arrays, so a loss written as on one device
is the global batch's.

Inside a unit call each device runs the unit's code on its rows of the batch:

* array arguments whose leading axis has the length of the first array
  argument's are split with it along that axis; other arguments (positions,
  flags, tables) reach every device whole;
* outputs (and values the unit sows) with that leading axis come back as
  one batch; any other output is a statistic of this device's rows alone,
  so it raises a UsageError unless `shard`'s `outputs` declares how it
  combines ("mean", "sum": exact for a mean or a sum over the rows);
* decoding caches (`nnx.Cache`) with the batch's leading axis are split
  with it;
* code that reduces over the rows without combining the result over the
  devices (a batch norm of one's own) is refused (`zpp_jax.rows`);
* `nnx.BatchNorm` inside a unit averages its statistics over all devices, so
  they equal the statistics of the global batch;
* random streams give every device its own key (folded with the device
  index): dropout masks differ across devices and follow from the seed;
* other state of the unit (batch statistics, random counters) must come out
  the same on every device, as these do.

The memory a unit keeps from its forward to its backward pass is its inputs
and, with hpZ, its secondary shard: never its full weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from zpp_jax.config import ZeroPPConfig, check_block_sizes
from zpp_jax.errors import UsageError, check_compute_dtype, check_policy
from zpp_jax.frozen import (
    FrozenParam,
    FrozenWeights,
    call_operands,
    freeze_predicate,
    freeze_unit,
)
from zpp_jax.mesh import AXES, mesh_shape, on_mesh
from zpp_jax.metadata import (
    SHARD_ALONG,
    Rules,
    check_model_axis,
    check_shard_along,
    model_dim,
    place_variable,
)
from zpp_jax.on_device import check_batch_axis_name, constraint_axes
from zpp_jax.outputs import Outputs, check_outputs, emptied_sown, merge_sown
from zpp_jax.partition import quant_float_dtypes
from zpp_jax.paths import is_container, node_at, set_at
from zpp_jax.pytrees import with_values
from zpp_jax.unit import (
    UnitInfo,
    check_units,
    run_unit,
    unit_infos,
    unit_scope,
    zero_residual,
)

Path = tuple
Policy = Callable[[Path, nnx.Module], bool] | Sequence[type] | Sequence[Path] | None


class FeedbackResidual(nnx.Variable):
    """A unit's error-feedback residual (with ``config.error_feedback``): the
    rounding error of its quantized gradient reduction, per device, carried
    to the next step. Not a parameter: the optimizer never sees it."""


# -- choosing units -----------------------------------------------------------


def _children(module: nnx.Module) -> list[tuple[Path, nnx.Module]]:
    """Direct child modules, elements of module lists and dicts included, with
    their paths relative to `module`."""
    out = []
    for path, node in nnx.iter_modules(module):
        if path and isinstance(node, nnx.Module) and not isinstance(node, nnx.List | nnx.Dict):
            # a direct child: no module between it and `module` but containers
            parents = [path[:i] for i in range(1, len(path))]
            if all(is_container(node_at(module, p)) for p in parents):
                out.append((path, node))
    return out


def _has_params(module: nnx.Module) -> bool:
    return bool(jax.tree.leaves(nnx.state(module, nnx.Param)))


def _has_layers(module: nnx.Module) -> bool:
    """A list or dict of modules, or a stacked module, somewhere inside."""
    for path, node in nnx.iter_modules(module):
        if path and (is_container(node_at(module, path[:-1])) or _looks_stacked(node)):
            return True
    return False


def _looks_stacked(module: nnx.Module) -> bool:
    """A module made by `nnx.vmap` (a stack of layers for `nnx.scan`): every
    variable shares one leading axis, and it has submodules or random streams
    of its own (a lone `nnx.Linear` whose dimensions happen to agree is not a
    stack). Only where units are cut and how they are stored depend on it."""
    variables = jax.tree.leaves(nnx.state(module))
    if not variables or not all(np.ndim(v) >= 1 for v in variables):
        return False
    if len({np.shape(v)[0] for v in variables}) != 1:
        return False
    has_children = any(path for path, _ in nnx.iter_modules(module))
    has_rng = bool(jax.tree.leaves(nnx.state(module, nnx.RngKey)))
    return (has_children or has_rng) and not _holds_one_layer(module)


def _holds_one_layer(module: nnx.Module) -> bool:
    """Some Flax layer inside `module` holds a parameter of exactly the shape
    its own sizes declare (a `nnx.Linear` kernel of (in_features,
    out_features), a norm scale of (num_features,), an `nnx.Embed` table):
    one layer, not a stack of them, whose variables merely share a leading
    size (a final norm and an LM head with d_model == vocab_size)."""

    def declared(m):
        if isinstance(m, nnx.Linear):
            return m.kernel, (m.in_features, m.out_features)
        if isinstance(m, nnx.Embed):
            return m.embedding, (m.num_embeddings, m.features)
        if isinstance(m, nnx.LayerNorm | nnx.RMSNorm) and m.scale is not None:
            return m.scale, (m.num_features,)
        return None, None

    for _, m in nnx.iter_modules(module):
        param, shape = declared(m)
        if param is not None and np.shape(param) == shape:
            return True
    return False


def default_units(model: nnx.Module) -> list[Path]:
    """The units `zpp.shard` picks when no policy is given. Descending from
    the model through modules that hold layers (a list or dict of modules,
    or a stacked module, somewhere inside): every element of a list or dict
    of modules is a unit (a layer, whatever it holds), every stacked module
    is one (one gather per layer under `nnx.scan`), and so is every other
    child with parameters. Parameters held directly by the modules passed
    through are sharded too, and gathered by XLA where they are used."""
    units = []

    def visit(path, module, top):
        if not top and (_looks_stacked(module) or not _has_layers(module)):
            if _has_params(module):
                units.append(path)
            return
        for sub, child in _children(module):
            if len(sub) > 1:  # an element of a list or dict of modules: a layer
                if _has_params(child):
                    units.append(path + sub)
            else:
                visit(path + sub, child, False)

    visit((), model, True)
    return units


def _select(model: nnx.Module, policy: Policy) -> list[Path]:
    check_policy(policy, "zpp.shard")
    if policy is None:
        units = default_units(model)
    else:
        modules = [(p, m) for p, m in nnx.iter_modules(model) if not is_container(m)]
        if callable(policy) and not isinstance(policy, type):
            units = [p for p, m in modules if policy(p, m)]
        elif all(isinstance(x, type) for x in policy):
            units = [p for p, m in modules if isinstance(m, tuple(policy))]
        else:
            wanted = [tuple(p) for p in policy]
            known = {p for p, _ in modules}
            missing = [p for p in wanted if p not in known]
            if missing:
                raise UsageError(f"the policy names modules the model does not have: {missing}")
            units = wanted
    units = [p for p in units if _has_params(node_at(model, p))]
    check_units(
        units,
        "give zpp.shard a policy that names submodules (a function (path, module) -> bool, "
        "module types, or paths), or policy=None for the default",
    )
    return units


def _name(path: Path) -> str:
    return "/".join(str(k) for k in path) or "<the model>"


# -- storage -------------------------------------------------------------------


@functools.cache
def _sharded_class(cls: type) -> type:
    """`cls` with its ``__call__`` routed through the engine (one subclass per
    class, memoized, so that identical units have identical graph
    definitions)."""
    return type(cls.__name__, (cls,), {"__call__": _unit_call, "_zpp_base": cls})


def shard(
    model: nnx.Module,
    mesh: Mesh,
    config: ZeroPPConfig | None = None,
    policy: Policy = None,
    compute_dtype: jax.typing.DTypeLike | None = None,
    *,
    outputs: Outputs = None,
    freeze: nnx.filterlib.Filter | None = None,
    batch_axis_name: str | None = None,
    rules: Rules = None,
    shard_along: Sequence[str] = SHARD_ALONG,
) -> nnx.Module:
    """Shard `model` for ZeRO++ over `mesh` (a `make_mesh` mesh; one with a
    `model` axis adds tensor parallelism: `zpp_jax.tensor`), in place.
    Returns the same module. Its ``__call__`` and the standard NNX loop
    (`nnx.Optimizer(model, tx, wrt=nnx.Param)`, `nnx.value_and_grad`,
    `nnx.jit`, `model.train()` / `model.eval()`) work unchanged; every
    parameter keeps its path, shape and dtype, stored split over the devices
    along its first dimension that the device count divides (or whole, if
    none does). Feed batches sharded along their first axis
    (`zpp.batch_sharding(mesh)`).

    Args:
      policy: which submodules are units. None: `default_units`. A function
        ``(path, module) -> bool``, a sequence of module types, or a sequence
        of paths. Units must not contain each other.
      compute_dtype: cast each unit's gathered weights to this dtype (mixed
        precision). Default None: the model's own dtypes, unchanged.
      outputs: how a unit's outputs that are not per example (an auxiliary
        loss, a count over the batch) combine over the devices: "mean"
        (exact for a mean over the rows), "sum", or a function ``(unit
        path, output name) -> "batch" | "mean" | "sum" | None``
        (`zpp_jax.outputs.combine_outputs`). Undeclared, such an output
        raises UsageError: it would be one device's alone.
      freeze: an NNX filter of parameters that train nothing (a LoRA's
        base: ``zpp_jax.lora.FROZEN``), stored as `zpp_jax.frozen` says.
      batch_axis_name: the model's own name for the data-parallel devices,
        as models written for ``pmap`` have it (``BatchNorm(axis_name=
        "batch")``, ``lax.pmean(x, "batch")``): inside units its collectives
        run over every device (`zpp_jax.on_device`). Without it, UsageError.
      rules: logical axis rules for sharding names (default: those in scope).
      shard_along: the mesh axes FSDP shards parameters over: a parameter
        with sharding names is split along the dimension they map to one of
        them (`zpp_jax.metadata`); `unshard` gives back the author's names.

    With ``config.error_feedback`` each unit also holds a `FeedbackResidual`;
    take gradients with `zpp.value_and_grad` to carry it between steps. A
    model built abstractly (``nnx.eval_shape``) is sharded abstractly:
    nothing is allocated; its steps compile for a compile-only mesh.

    Memory per device: each parameter's block (1/N; 1/(N t) split over a
    `model` axis of t) in its own dtype, whole copies of parameters no
    dimension of which N divides, with error feedback (1 + 1/local) x each
    unit's size in ``config.residual_dtype``; other arrays replicated.

    Values a unit sows (``sow``, `nnx.capture`) follow its outputs' rule;
    decoding caches (`nnx.Cache`) are split with the batch.

    Raises:
      UsageError: a mesh without (`node`, `local`) axes, a policy that selects
        no unit or overlapping units, a parameter that is not floating point,
        a `model` axis that no parameter's names map to.
    """
    config = ZeroPPConfig.check(config)
    check_outputs(outputs)
    check_batch_axis_name(batch_axis_name)
    _check_model(model, mesh, config)
    dtype = check_compute_dtype(compute_dtype)
    units, frozen = _select(model, policy), freeze_predicate(freeze)
    rules = rules if rules is not None else nn.get_logical_axis_rules()
    along = check_shard_along(shard_along)
    plan = _Plan(mesh, config, dtype, outputs, frozen, batch_axis_name, rules, along)
    _check_model_axis(model, plan)
    for path in units:
        _make_unit(node_at(model, path), plan, _name(path))
    _place_outside_units(model, plan, set(units))
    # The rest whole on every device: a jitted step then takes it with the
    # sharding it returns it with, and compiles once.
    return on_mesh(model, mesh)


def _check_model(model, mesh: Mesh, config: ZeroPPConfig) -> None:
    """Raise UsageError unless `model` is an NNX module not yet sharded,
    with floating-point parameters that `config`'s blocks fit, and `mesh` a
    (`node`, `local`) mesh."""
    if not isinstance(model, nnx.Module):
        raise UsageError(
            f"zpp.shard takes a Flax NNX module, got {type(model).__name__}; for Linen use "
            "zpp.shard_linen"
        )
    mesh_shape(mesh)  # raises for a mesh without (node, local) axes
    floats = quant_float_dtypes()
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        dtype = jnp.result_type(value.get_value())
        if jnp.dtype(dtype) not in floats:
            raise UsageError(
                f"parameter {_name(path)} has dtype {jnp.dtype(dtype).name}; ZeRO++ shards "
                "float32, bfloat16 and float16 parameters. Keep integer state in another "
                "nnx.Variable type (not nnx.Param), or cast it to a float dtype"
            )
    check_block_sizes(
        config, [int(np.size(v)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    )
    if unit_infos(model):
        raise UsageError(
            "this model is already sharded (zpp.shard ran on it): use it as it is, or shard "
            "zpp.unshard(model) for another mesh or config"
        )


def _check_model_axis(model, plan: _Plan) -> None:
    """`check_model_axis` of the model's parameters, before any is placed."""
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    dims = [model_dim(v, plan.mesh, plan.rules, _name(p)) for p, v in params]
    refused = "error feedback" if plan.config.error_feedback else "freeze=" if plan.frozen else None
    check_model_axis(dims, plan.mesh, refused)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How `shard` stores a model: its arguments, checked."""

    mesh: Mesh
    config: ZeroPPConfig
    compute_dtype: Any
    outputs: Outputs
    frozen: Any  # a predicate (path, variable) -> bool, or None
    batch_axis_name: str | None
    rules: Any  # logical axis rules for the variables' sharding names
    along: tuple[str, ...]  # mesh axes whose named dimension is split


def _place_outside_units(model, plan: _Plan, unit_paths: set) -> None:
    """Parameters outside every unit: stored split the same way, gathered by
    XLA (unquantized) where the model's own code uses them; frozen ones as
    `FrozenParam`s."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if any(path[: len(u)] == u for u in unit_paths):
            continue
        place_variable(var, plan.mesh, plan.config, False, plan.rules, plan.along, _name(path))
        if plan.frozen and plan.frozen(path, var):
            set_at(model, path, FrozenParam(var.get_value()))


def _make_unit(module, plan: _Plan, name: str) -> None:
    mesh, config, frozen = plan.mesh, plan.config, plan.frozen
    stacked = _looks_stacked(module)
    params = nnx.to_flat_state(nnx.state(module, nnx.Param))
    specs = ()
    if frozen:
        held = [(p, v) for p, v in params if frozen(p, v)]
        specs = freeze_unit(module, held, mesh, config, stacked, name) if held else ()
        params = [(p, v) for p, v in params if not frozen(p, v)]
    dims, model_dims = [], []
    for path, var in params:
        where = f"{name}/{_name(path)}"
        dim, tp = place_variable(var, mesh, config, stacked, plan.rules, plan.along, where)
        dims.append((path, dim, np.ndim(var.get_value())))
        model_dims.append((path, tp))
    if config.error_feedback:
        lead = 1 if stacked else 0
        call = [
            (np.shape(var.get_value())[lead:], jnp.float32, dim - lead)
            for (_, var), (_, dim, _) in zip(params, dims, strict=True)
            if dim is not None and dim >= lead
        ]
        if call:
            first = params[0][1].get_value()
            lead_shape = np.shape(first)[:1] if stacked else ()
            abstract = isinstance(first, jax.ShapeDtypeStruct)
            module._zpp_residual = FeedbackResidual(
                zero_residual(config, call, mesh, lead_shape, abstract)
            )
    module._zpp = UnitInfo(
        mesh,
        config,
        plan.compute_dtype,
        tuple(dims),
        stacked,
        name,
        plan.outputs,
        specs,
        plan.batch_axis_name,
        tuple(model_dims),
        constraint_axes(plan.rules, plan.along),
    )
    module.__class__ = _sharded_class(type(module))


# -- one call of a unit ----------------------------------------------------------

# Sown values: what `Module.sow` writes (attributes, or `nnx.capture`'s
# dicts); perturbations stay state (their values are inputs, not outputs).
_SOWN = nnx.All(nnx.Intermediate, nnx.Not(nnx.Perturbation))
_FROZEN = nnx.Any(FrozenParam, FrozenWeights)
_REST = nnx.Not(nnx.Any(nnx.Param, FeedbackResidual, _FROZEN, _SOWN))


def _unit_call(self, *args, **kwargs):
    """A unit's ``__call__``: the engine around the class's own."""
    info: UnitInfo = self._zpp
    base = type(self)._zpp_base
    graphdef, params, feedback, frozen, sown, rest = nnx.split(
        self, nnx.Param, FeedbackResidual, _FROZEN, _SOWN, _REST
    )
    param_items = nnx.to_flat_state(params)
    frozen_items = nnx.to_flat_state(frozen)
    feedback_items = nnx.to_flat_state(feedback)
    sown_items = nnx.to_flat_state(sown)
    rest_items = nnx.to_flat_state(rest)
    stored = {path: (dim, ndim) for path, dim, ndim in info.dims}
    emptied = [emptied_sown(info, path, var.get_value()) for path, var in sown_items]
    sown_types: dict[str, tuple] = {}  # what the call sowed: name -> (path, variable type)

    def run(values, rest_values, call_args, call_kwargs):
        module = nnx.merge(
            graphdef,
            with_values(param_items, [values[p] for p, _ in param_items]),
            with_values(feedback_items, [jnp.zeros((), v.dtype) for _, v in feedback_items]),
            with_values(frozen_items, [values.get(p) for p, _ in frozen_items]),
            with_values(sown_items, emptied),
            with_values(rest_items, rest_values),
        )
        for _, sub in nnx.iter_modules(module):
            if isinstance(sub, nnx.BatchNorm) and sub.axis_name is None:
                sub.axis_name = AXES  # statistics of the global batch
        out = base.__call__(module, *call_args, **call_kwargs)
        new_rest = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(module, _REST))]
        new_sown = {}
        for path, var in nnx.to_flat_state(nnx.state(module, _SOWN)):
            value = var.get_value()
            # nnx.capture's record: {name: value} in the module's __captures__
            entries = value.items() if isinstance(value, dict) else [(None, value)]
            owner = path[:-2] if isinstance(value, dict) else path[:-1]
            for key, v in entries:
                if jax.tree.leaves(v):
                    name = "/".join(str(k) for k in (*owner, key if key else path[-1]))
                    sown_types[name] = (path, type(var), key)
                    new_sown[name] = v
        return out, new_rest, new_sown

    kinds = [_state_kind(var) for _, var in rest_items]
    with jax.named_scope(unit_scope(info.name)):
        out, new_rest, new_sown = run_unit(
            info,
            [(p, var.get_value(), *stored[p]) for p, var in param_items],
            [(var.get_value(), kind) for (_, var), kind in zip(rest_items, kinds, strict=True)],
            feedback_items[0][1].get_value() if feedback_items else None,
            args,
            kwargs,
            run,
            call_operands(frozen_items),
        )
    nnx.update(self, with_values(rest_items, new_rest))
    for name, value in new_sown.items():
        merge_sown(self, info, *sown_types[name], value)
    return out


def _state_kind(var: nnx.Variable) -> str:
    if isinstance(var, nnx.RngKey):
        return "key"
    return "cache" if isinstance(var, nnx.Cache) else "state"
