"""Parameter pytrees <-> flat, padded fp32 primary shards.

All leaves of one pytree (typically one layer) are concatenated into one flat
fp32 vector, padded to a multiple of the device count N and cut into N equal
shards of s elements, one per device. One layer then costs one collective per
direction, whatever its number of leaves. Leaves of any shape work (scalars,
biases, prime sizes); padding is zero and never reaches the layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax import quant
from zpp_jax.errors import UsageError
from zpp_jax.mesh import AXES, mesh_shape

PyTree = Any


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each leaf of a pytree lives in the flat vector, and how it is sharded.

    Attributes:
      treedef: the pytree structure.
      shapes, dtypes: per leaf, of one layer (without a stacking axis).
      offsets: start of each leaf in the flat vector (multiples of `align`).
      size: extent of the data: end of the last leaf (alignment gaps included).
      num_shards: N, the number of devices sharing the vector.
      shard_size: s = ceil(size / N) rounded up to a multiple of `align`; the
        padded vector has N*s elements.
      align: with align = the quantization block size, every leaf starts on a
        block boundary and so does every shard, so no quantization block mixes
        two tensors (a LayerNorm scale of ~1 would otherwise set the scale of
        a block of weights of ~0.02). Costs < align zeros per leaf.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    offsets: tuple[int, ...]
    size: int
    num_shards: int
    shard_size: int
    align: int = 1

    @property
    def padded_size(self) -> int:
        return self.num_shards * self.shard_size

    @classmethod
    def from_tree(
        cls, tree: PyTree, num_shards: int, stacked: bool = False, align: int = 1
    ) -> FlatLayout:
        """Layout of `tree` over `num_shards` devices.

        With `stacked`, every leaf has a leading layer axis that is not part of
        the layout (layers under `lax.scan`).

        Raises:
          ValueError: a leaf that is not float32/bfloat16/float16, an empty
            tree, or a stacked tree whose leaves disagree on the layer count.
        """
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            raise UsageError("cannot partition an empty parameter pytree")
        if not isinstance(num_shards, int) or num_shards <= 0:
            raise UsageError(f"num_shards must be a positive int, got {num_shards!r}")
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        shapes, dtypes = [], []
        for path, leaf in zip(paths, leaves, strict=True):
            dtype = jnp.result_type(leaf)
            if not jnp.issubdtype(dtype, jnp.floating) or dtype not in quant_float_dtypes():
                raise UsageError(
                    f"parameter {path or '<root>'} has dtype {jnp.dtype(dtype).name}; ZeRO++ "
                    "shards float32, bfloat16 and float16 parameters only. Keep integer "
                    "state outside the sharded parameters, or cast it to a float dtype"
                )
            shape = tuple(np.shape(leaf))
            if stacked:
                if not shape:
                    raise UsageError(
                        f"stacked parameter {path} is a scalar; it needs a leading layer axis"
                    )
                shape = shape[1:]
            shapes.append(shape)
            dtypes.append(jnp.dtype(dtype))
        if stacked and len({np.shape(leaf)[0] for leaf in leaves}) != 1:
            raise UsageError("stacked parameters disagree on the number of layers (leading axis)")
        if not isinstance(align, int) or align <= 0:
            raise UsageError(f"align must be a positive int, got {align!r}")
        sizes = [math.prod(s) for s in shapes]
        if sum(sizes) == 0:
            raise UsageError("cannot partition parameters with zero elements")
        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end += -(-n // align) * align if n else 0
        size = offsets[-1] + sizes[-1]
        per_device = -(-size // num_shards)
        shard_size = -(-per_device // align) * align
        return cls(
            treedef,
            tuple(shapes),
            tuple(dtypes),
            tuple(offsets),
            size,
            num_shards,
            shard_size,
            align,
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    def flatten(self, tree: PyTree) -> jax.Array:
        """The padded fp32 vector (N*s,) of one layer's pytree (traceable)."""
        leaves = self.treedef.flatten_up_to(tree)
        parts, end = [], 0
        for leaf, off in zip(leaves, self.offsets, strict=True):
            if off > end:
                parts.append(jnp.zeros((off - end,), jnp.float32))
            parts.append(jnp.ravel(leaf).astype(jnp.float32))
            end = off + math.prod(np.shape(leaf))
        if self.padded_size > end:
            parts.append(jnp.zeros((self.padded_size - end,), jnp.float32))
        return jnp.concatenate(parts)

    def unflatten(self, flat: jax.Array, dtype=None) -> PyTree:
        """The pytree from a flat vector of at least `size` elements (traceable).

        Leaves get their original dtypes, or `dtype` if given.
        """
        leaves = []
        for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets, strict=True):
            n = math.prod(shape)
            leaf = jax.lax.slice_in_dim(flat, off, off + n).reshape(shape)
            leaves.append(leaf.astype(dt if dtype is None else dtype))
        return self.treedef.unflatten(leaves)


def quant_float_dtypes():
    return [jnp.dtype(d) for d in quant.FLOAT_DTYPES]


def shard_spec(stacked: bool = False) -> P:
    """PartitionSpec of a primary-shard array: its flat axis over (`node`, `local`)."""
    return P(None, AXES) if stacked else P(AXES)


def shard_params(
    tree: PyTree, mesh: Mesh, stacked: bool = False, align: int = 1
) -> tuple[jax.Array, FlatLayout]:
    """Flatten, pad and shard a pytree onto `mesh`.

    Returns the fp32 primary-shard array, shape (N*s,) (or (layers, N*s) when
    `stacked`) sharded so each device holds s (or layers x s) elements, and the
    layout to undo it. Pass ``align=config.alignment`` so that quantization
    blocks never straddle two tensors. Memory kept: 4 bytes per parameter over N devices.
    """
    nodes, local = mesh_shape(mesh)
    layout = FlatLayout.from_tree(tree, nodes * local, stacked=stacked, align=align)
    flatten = jax.vmap(layout.flatten) if stacked else layout.flatten
    out = NamedSharding(mesh, shard_spec(stacked))
    return jax.jit(flatten, out_shardings=out)(tree), layout


def unshard_params(shards: jax.Array, layout: FlatLayout, stacked: bool = False) -> PyTree:
    """The original pytree (original dtypes) from primary shards, for export
    and inspection. Gathers the whole model onto every device."""
    unflatten = jax.vmap(layout.unflatten) if stacked else layout.unflatten
    return jax.jit(unflatten)(shards)
