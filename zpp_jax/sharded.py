"""A `shard`ed NNX model in use: its gradients (`value_and_grad`, `grad`,
which carry the error-feedback residuals), its plain copy (`unshard`), and what
a training step needs to know of its units."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.errors import UsageError
from zpp_jax.frozen import FrozenParam, FrozenWeights, decode_frozen
from zpp_jax.metadata import restore_layout
from zpp_jax.overlap import overlap_options, prefetches
from zpp_jax.overlap.loops import unroll_relayed_loops
from zpp_jax.overlap.relay import relay_scope
from zpp_jax.paths import set_at
from zpp_jax.shard import FeedbackResidual
from zpp_jax.unit import UnitInfo, unit_infos


def has_stacked_units(model: nnx.Module) -> bool:
    """Whether any unit of a model `shard` sharded is a stack of layers (run
    by a layer loop, ``nnx.scan``) rather than one layer called once."""
    return any(info.stacked for info in unit_infos(model))


def compiler_options(model: nnx.Module, mesh: Mesh) -> dict:
    """The XLA options a step of this sharded model compiles with on `mesh`
    (`zpp_jax.overlap.overlap_options`): for relayed units (no layer loop, or
    its loops unrolled), those that let their collectives of different
    kinds be in flight together."""
    return overlap_options(
        mesh, unrolled=not has_stacked_units(model) or unrolls_layer_loops(model)
    )


def unrolls_layer_loops(model: nnx.Module) -> bool:
    """Whether a step of this sharded model unrolls its layer loops (see
    `ZeroPPConfig.unroll_layer_loops`): some unit is a stack, on a mesh whose
    units relay their collectives, configured to."""
    return any(
        info.stacked and info.config.unroll_layer_loops and prefetches(info.mesh)
        for info in unit_infos(model)
    )


def unshard(model: nnx.Module) -> nnx.Module:
    """A plain copy of a `shard`ed model: its own classes, every parameter
    whole on every device (evaluation, generation, export), no
    error-feedback residuals. Frozen weights come back as `nnx.Param`s
    holding what the model computed with (decoded from their codes). The
    sharded model is left as it is.

    Memory: the full model on every device.
    """
    graphdef, state = nnx.split(model)
    plain = nnx.merge(graphdef, state)
    mesh = None
    frozen = frozen_values(plain)
    for _, module in nnx.iter_modules(plain):
        info = getattr(module, "_zpp", None)
        if isinstance(info, UnitInfo):
            mesh = info.mesh
            module.__class__ = type(module)._zpp_base
            del module._zpp
            for name in ("_zpp_residual", "_zpp_frozen"):
                if hasattr(module, name):
                    delattr(module, name)
    if mesh is None:
        raise UsageError("zpp.unshard takes a model made by zpp.shard")
    for path, value in frozen.items():  # frozen weights as what the model computed with
        set_at(plain, path, nnx.Param(value))
    replicated = NamedSharding(mesh, P())
    for _, var in nnx.to_flat_state(nnx.state(plain, nnx.Param)):
        var.set_value(jax.device_put(var.get_value(), replicated))
        restore_layout(var)  # the author's sharding metadata
    return plain


def frozen_values(model: nnx.Module) -> dict[tuple, jax.Array]:
    """Every frozen parameter's value by its path: decoded from its unit's
    codes (what the model computes with), or the stored weight."""
    from zpp_jax.unit import UnitInfo

    out = {}
    for path, module in nnx.iter_modules(model):
        info = getattr(module, "_zpp", None)
        stored = getattr(module, "_zpp_frozen", None)
        if isinstance(info, UnitInfo) and isinstance(stored, FrozenWeights):
            n = info.mesh.devices.size
            values = decode_frozen(info.config, info.frozen, stored.get_value(), n)
            for spec, value in zip(info.frozen, values, strict=True):
                out[(*path, *spec.path)] = value
    for path, var in nnx.to_flat_state(nnx.state(model, FrozenParam)):
        if var.get_value() is not None:
            out[tuple(path)] = var.get_value()
    return out


def _with_feedback(argnums):
    """The `wrt` of a gradient that also carries the error-feedback residuals."""
    wrt = nnx.Any(nnx.Param, FeedbackResidual)
    if isinstance(argnums, int):
        return nnx.DiffState(argnums, wrt), (argnums,)
    return tuple(nnx.DiffState(a, wrt) for a in argnums), tuple(argnums)


def value_and_grad(
    f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """`nnx.value_and_grad`'s contract (and so JAX's: the value of `f` and
    its gradient with respect to the parameters, `nnx.Param`, of the modules
    at `argnums`) plus one thing: with error feedback, each unit's new
    `FeedbackResidual` is carried into its module for the next step. The
    gradients returned hold the parameters only (what
    `nnx.Optimizer.update` takes). Without error feedback it is
    ``nnx.value_and_grad(f, argnums=argnums)``; nothing else differs."""
    diff, positions = _with_feedback(argnums)
    inner = nnx.value_and_grad(f, argnums=diff, has_aux=has_aux)
    unrolled = nnx.value_and_grad(unroll_relayed_loops(f), argnums=diff, has_aux=has_aux)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        with relay_scope():
            value, grads = (unrolled if unrolls_layer_loops((args, kwargs)) else inner)(
                *args, **kwargs
            )
        grads_t = (grads,) if isinstance(argnums, int) else tuple(grads)
        out = []
        for pos, g in zip(positions, grads_t, strict=True):
            params, residuals = nnx.split_state(g, nnx.Param, FeedbackResidual)
            if jax.tree.leaves(residuals):
                nnx.update(args[pos], residuals)  # the next step's residuals
            out.append(params)
        return value, (out[0] if isinstance(argnums, int) else tuple(out))

    return wrapper


def grad(f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """`value_and_grad` without the value (nor the aux, which it returns
    with the gradients as ``(grads, aux)`` when `has_aux`)."""
    vg = value_and_grad(f, argnums, has_aux)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapper
