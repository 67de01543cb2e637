"""Frozen weights: parameters that train nothing (a LoRA's base), stored
in the qwZ block format and gathered as codes.

`zpp.shard(model, mesh, config, freeze=FILTER)` takes each unit's
parameters that FILTER names out of training (`freeze_unit`):

* the kernels of the linear layers a LoRA adapts (an `nnx.LoRA`'s base
  module's, an `nnx.LoRALinear`'s: `adapted_kernels`), where split over the
  devices, are quantized once (``config.frozen_bits``: 8 or 4 bits in
  blocks of ``config.block_size``; None keeps their dtype) and stored as
  one wire per device, a unit's `FrozenWeights`: what a forward gather of
  them would send, made once instead of every step. The parameters
  themselves become value-less `FrozenParam` placeholders that keep their
  path, shape and dtype; a call of the unit fills them with the weights
  decoded from the gathered codes. This is QLoRA's split: the adapted
  layers' base is quantized, nothing else is.
* the others (embeddings, norms, biases, an output head no adapter wraps,
  and every frozen parameter of a model without adapters) keep their own
  dtype and values, as `FrozenParam`s split like trained parameters (or
  whole, when too small to split). A unit's call gathers them unquantized
  (XLA's all-gather), and the model's own code may use them outside a call
  too, as a tied LM head uses the embedding (`nnx.Embed.attend`). An
  export of the model gives them back bit for bit.

Frozen parameters outside every unit (those a policy leaves out) become
`FrozenParam`s with their value, split as other parameters are: nothing
trains them, and they are not quantized.

Memory per device: about bits/8 bytes per element of an adapted kernel
over N (a quarter or an eighth of fp32), plus a 4-byte scale per block;
the other frozen parameters, their own bytes over N. The codes'
blocks follow each device's share, so a checkpoint of them restores onto
a mesh of the same size only (`Checkpointer.restore` says so).

None of them is an `nnx.Param`, so optimizers (``wrt=nnx.Param``) and
gradients skip them. `zpp_jax.sharded.frozen_values` decodes them back
(for export or a reference model).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.mesh import AXES, place, shard_dim, spec_along
from zpp_jax.partition import ParamLayout, call_layout
from zpp_jax.paths import set_at
from zpp_jax.wire import WeightWire

# What a user meets (the variable types in a sharded model's state); the
# rest is the engine's.
__all__ = ["FrozenParam", "FrozenWeights", "adapted_kernels"]


class FrozenParam(nnx.Variable):
    """A parameter that trains nothing. Value None inside a unit (its
    codes are in the unit's `FrozenWeights`; metadata `shape`, `dtype`),
    else the weight itself."""


class FrozenWeights(nnx.Variable):
    """A unit's frozen weights as they travel: each device's wire
    (`WeightWire.encode` of its blocks), concatenated over the devices and
    split over them again."""


@dataclasses.dataclass(frozen=True)
class FrozenSpec:
    """One split frozen parameter of a unit: its path in the unit, shape,
    dtype and split dimension, as stored."""

    path: tuple
    shape: tuple[int, ...]
    dtype: Any
    dim: int


def frozen_config(config: ZeroPPConfig, dtypes=()) -> ZeroPPConfig:
    """The configuration frozen weights travel by: quantized with
    ``frozen_bits``, or, when None, as the raw bits of their own dtype
    (the widest of `dtypes`); no gradient settings."""
    bits = config.frozen_bits
    own = jnp.result_type(*dtypes).name if dtypes else "float32"
    return config.replace(
        quantize_weights=bits is not None,
        weight_bits=config.weight_bits if bits is None else bits,
        quantize_gradients=False,
        error_feedback=False,
        comm_dtype=config.comm_dtype if bits is not None else own,
    )


def frozen_layout(config: ZeroPPConfig, specs: tuple[FrozenSpec, ...], n: int) -> ParamLayout:
    """The per-device layout of a unit's split frozen parameters: a call's
    layout (`call_layout`) under the configuration they travel by."""
    return call_layout(frozen_config(config), [(s.shape, s.dtype, s.dim) for s in specs], n)


def frozen_wire(config: ZeroPPConfig, layout: ParamLayout, compute_dtype=None) -> WeightWire:
    """How a unit's frozen weights (`layout`) are stored and travel."""
    return WeightWire(layout, frozen_config(config, layout.dtypes), compute_dtype)


def encode_frozen(
    config: ZeroPPConfig, specs: tuple[FrozenSpec, ...], values: list, mesh: Mesh
) -> jax.Array | jax.ShapeDtypeStruct:
    """Every device's wire of `values` (the split frozen parameters,
    placed as `specs` says), (N * bytes,) split over the devices; abstract
    values give the abstract result."""
    n = mesh.devices.size
    layout = frozen_layout(config, specs, n)
    wire = frozen_wire(config, layout)

    def local(*blocks):
        return wire.encode(layout.pack(layout.treedef.unflatten(list(blocks))))

    in_specs = tuple(spec_along(len(s.shape), s.dim) for s in specs)
    encode = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(AXES), check_vma=False)
    )
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in values):
        out = jax.eval_shape(encode, *values)
        return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=NamedSharding(mesh, P(AXES)))
    return encode(*values)


def decode_frozen(
    config: ZeroPPConfig, specs: tuple[FrozenSpec, ...], stored: jax.Array, n: int
) -> list[jax.Array]:
    """The full frozen parameters (in their dtype) from a unit's stored
    wire (global view: gathers it). For export and reference models."""
    layout = frozen_layout(config, specs, n)
    wire = frozen_wire(config, layout)
    rows = jnp.asarray(stored).reshape(n, -1)
    return jax.tree.leaves(jax.jit(wire.decode)(rows))


def adapted_kernels(module: nnx.Module) -> set[tuple]:
    """Paths, in `module`, of the kernels its LoRA adapters adapt: each
    `nnx.LoRA`'s base module's kernel and each `nnx.LoRALinear`'s."""
    paths = set()
    for path, sub in nnx.iter_modules(module):
        if isinstance(sub, nnx.LoRALinear):
            paths.add((*path, "kernel"))
        elif isinstance(sub, nnx.LoRA) and _has_kernel(sub.base_module):
            paths.add((*path, "base_module", "kernel"))
    return paths


def _has_kernel(module) -> bool:
    return isinstance(getattr(module, "kernel", None), nnx.Variable)


def freeze_unit(
    module: nnx.Module, frozen: list, mesh: Mesh, config: ZeroPPConfig, stacked: bool, name: str
) -> tuple[FrozenSpec, ...]:
    """Store the unit `module`'s `frozen` parameters ((path, variable)
    pairs) as frozen weights: the split kernels LoRA adapts
    (`adapted_kernels`) as one `FrozenWeights` wire (``module._zpp_frozen``)
    and value-less `FrozenParam`s; the others as `FrozenParam`s holding
    their value, split over the devices (or whole, when too small). Returns
    the wire's specs, for the unit's calls.

    Memory per device: the wire, about bits/8 bytes per element over N
    (plus a scale per block), and the others in their dtype over N.
    """
    if stacked:
        raise UsageError(
            f"unit {name} is a stack of layers (nnx.scan / nnx.vmap); frozen weights are "
            "stored for units of one layer: build the model's layers as a list"
        )
    n, adapted = mesh.devices.size, adapted_kernels(module)
    specs, values = [], []
    for path, var in frozen:
        value = var.get_value()
        dim = shard_dim(np.shape(value), n, False, keep_below=config.persistence_threshold)
        if dim is None or tuple(path) not in adapted:
            set_at(module, path, FrozenParam(place(value, mesh, dim)))
            continue
        dtype = jnp.dtype(value.dtype)
        specs.append(FrozenSpec(tuple(path), tuple(np.shape(value)), dtype, dim))
        values.append(place(value, mesh, dim))
        set_at(module, path, FrozenParam(None, shape=tuple(np.shape(value)), dtype=dtype))
    if specs:
        module._zpp_frozen = FrozenWeights(encode_frozen(config, tuple(specs), values, mesh))
    return tuple(specs)


def call_operands(items) -> tuple:
    """(The unit's stored frozen wire or None, (path, value) of each frozen
    parameter that holds its value)."""
    stored = [v.get_value() for _, v in items if isinstance(v, FrozenWeights)]
    whole = [
        (p, v.get_value())
        for p, v in items
        if isinstance(v, FrozenParam) and v.get_value() is not None
    ]
    return (stored[0] if stored else None), whole


def freeze_predicate(freeze):
    """`freeze` as a predicate of (path, variable) (None: nothing frozen);
    UsageError unless it is an NNX filter, a callable one taking those two
    arguments."""
    if freeze is None:
        return None
    message = (
        f"freeze={freeze!r} is not an NNX filter: pass a Variable type (nnx.Param), a path or "
        "name, a predicate (path, variable) -> bool, or zpp_jax.lora.FROZEN"
    )
    try:
        predicate = nnx.filterlib.to_predicate(freeze)
        if predicate is freeze:  # the user's own callable
            inspect.signature(freeze).bind((), None)
    except (TypeError, ValueError):
        raise UsageError(message) from None
    return predicate
