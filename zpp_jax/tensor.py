"""Tensor parallelism inside a unit: the mesh's `model` axis.

A unit's call is a `jax.shard_map` manual over the data-parallel axes
(`node`, `local`) only. `model` stays Auto: the unit's own code runs in
global view along it, so XLA partitions its matrix multiplies as the
parameters' and activations' shardings say (Megatron's column and row
splits, from the model's own sharding names).

ZeRO++ runs per model rank. Each parameter is split along the dimension its
names map to `model` (its *model dimension*) and, inside each rank's slice,
along another dimension over the data-parallel devices. The engine's
machinery (pack, quantize, gather, decode; reduce, quantize) runs in a
nested `jax.shard_map` manual over `model`, where each rank sees its slice
of every parameter as an ordinary ZeRO++ layout of its own: every collective
runs over the data axes only and moves 1/t of a layer's bytes, and hpZ's
secondary partition and qgZ's hierarchy are those of the rank's data
devices. A parameter without a model dimension (a norm's scale) is the same
on every rank; each rank gathers and reduces all of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from zpp_jax.mesh import MODEL
from zpp_jax.overlap import relay

PyTree = Any

# A value each rank holds its own of, stacked along a new leading axis.
STACKED = P(MODEL)


@dataclasses.dataclass(frozen=True)
class ModelSplit:
    """How a unit's split parameters lie along `model`.

    Attributes:
      degree: t, the size of the `model` axis.
      dims: per parameter (the layout's leaves, in order), the dimension
        split over `model` in the shape a call sees, or None (whole on every
        rank).
    """

    degree: int
    dims: tuple[int | None, ...]

    def rank_shape(self, shape: tuple[int, ...], i: int) -> tuple[int, ...]:
        """Parameter i's shape on one model rank."""
        dim = self.dims[i]
        if dim is None:
            return tuple(shape)
        return shape[:dim] + (shape[dim] // self.degree,) + shape[dim + 1 :]

    def leaf_specs(self, treedef) -> PyTree:
        """The parameters' PartitionSpecs along `model`, as a pytree of `treedef`."""
        return treedef.unflatten([P() if d is None else P(*([None] * d), MODEL) for d in self.dims])

    def per_rank(self, f: Callable, in_specs, out_specs) -> Callable:
        """`f` run on each model rank's part (a `jax.shard_map` manual over
        `model`, nested in the unit's over the data axes). Costs nothing
        by itself: the parts are where they lie."""
        return jax.shard_map(
            f, in_specs=in_specs, out_specs=out_specs, axis_names={MODEL}, check_vma=False
        )

    def gather(self, gather_rank: Callable, shard: jax.Array, layout, hpz: bool, token=None):
        """``gather_rank(shard, token) -> (params, secondary)`` on each
        rank's vector of the (t x s,) `shard`: the full parameters, split
        along `model` as their names say, and hpZ's secondary `STACKED` (or
        None). Each rank's collectives move its own s elements. `token`:
        the relay token (or None), the same on every rank, so that each
        rank's gathers wait on its own copy."""

        def rank(part, token):
            params, secondary = gather_rank(part, token)
            return (params,) if secondary is None else (params, jax.tree.map(_lead, secondary))

        specs = self.leaf_specs(layout.treedef)
        out_specs = (specs, STACKED) if hpz else (specs,)
        gathered = self.per_rank(rank, (STACKED, P()), out_specs)(shard, token)
        return gathered[0], (gathered[1] if hpz else None)

    def assemble(self, assemble: Callable, secondary, layout):
        """hpZ's re-gather, ``assemble(secondary) -> params``, on each rank's
        `STACKED` secondary."""
        specs = self.leaf_specs(layout.treedef)
        return self.per_rank(lambda s: assemble(_unstacked(s)), (STACKED,), specs)(secondary)

    def reduce(self, reduce_rank: Callable, grads, layout) -> tuple:
        """``reduce_rank(rank's gradient) -> (its shard, residual, qgZ's
        marker or None)``, on each rank's slice of the gradient `grads`:
        (the (t x s,) reduced shards, each rank's over the data axes, no
        residual, qgZ's marker, the reduction's marker). The markers are
        zeros that exist once a step of a rank's reduction has finished,
        the same on every rank, so that each rank's ties read its own."""

        def rank(g):
            shard, _, node_step = reduce_rank(g)
            return shard, (relay.done_marker(shard), node_step)

        specs = self.leaf_specs(layout.treedef)
        shards, (done, node_step) = self.per_rank(rank, (specs,), (STACKED, P()))(grads)
        return shards, None, node_step, done


def model_split(degree: int, stored: tuple, params, split) -> ModelSplit | None:
    """Where a call's split parameters lie along `model` (None without
    tensor parallelism). `stored`: (key, model dimension as stored) per
    parameter; `params`: (key, value, data dimension, ndim as stored) per
    parameter of the call; `split`: (key, value, data dimension) of those
    split over the data axes. Inside `nnx.scan` a stack's leading axis is
    gone, and the dimension moves down with it."""
    if degree == 1 or not split:
        return None
    dims, lead = dict(stored), {key: ndim - np.ndim(value) for key, value, _, ndim in params}
    moved = [None if dims.get(key) is None else dims[key] - lead[key] for key, _, _ in split]
    return ModelSplit(degree, tuple(moved))


def rank_params(split, model_split: ModelSplit | None) -> list[tuple]:
    """(shape on one model rank, dtype, data dimension) of each of a
    call's `split` parameters, (key, value, data dimension): what
    `partition.call_layout` lays out on each rank."""
    out = []
    for i, (_, value, dim) in enumerate(split):
        shape = np.shape(value)
        shape = shape if model_split is None else model_split.rank_shape(shape, i)
        out.append((shape, jnp.result_type(value), dim))
    return out


def packed(layout, split: ModelSplit | None, blocks: list) -> jax.Array:
    """This device's vector of a call's `blocks`: `layout.pack`, or with
    tensor parallelism `packed_per_rank`'s (t x s,)."""
    if split is None:
        return layout.pack(layout.treedef.unflatten(blocks))
    return packed_per_rank(layout, split)(blocks)


def packed_per_rank(layout, split: ModelSplit) -> Callable:
    """``blocks -> (t x s,)``: each model rank's vector (`layout.pack`) of
    its slice of the unit's blocks, laid along `model`. Its derivative
    hands each rank's part of the cotangent back to that rank's slice, and
    a parameter that is whole on every rank takes one rank's part: each
    rank's is the same reduced gradient, which autodiff of the
    concatenation would add up t times."""
    specs = tuple(jax.tree.leaves(split.leaf_specs(layout.treedef), is_leaf=_is_spec))

    def pack(*blocks):
        return layout.pack(layout.treedef.unflatten(blocks))

    to_vector = split.per_rank(pack, specs, STACKED)
    to_blocks = split.per_rank(lambda v: _unpack(layout, v), (STACKED,), specs)

    @jax.custom_vjp
    def packed(blocks):
        return to_vector(*blocks)

    def bwd(_, g):
        return (list(to_blocks(g)),)

    packed.defvjp(lambda blocks: (to_vector(*blocks), None), bwd)
    return packed


def _unpack(layout, vector: jax.Array) -> tuple[jax.Array, ...]:
    """A rank's blocks (leaves, in their dtypes) from its vector (s,): the
    inverse of `ParamLayout.pack`."""
    return tuple(
        lax.slice_in_dim(vector, off, off + k).reshape(block).astype(dt)
        for (off, k), block, dt in zip(
            layout.slices, layout.block_shapes, layout.dtypes, strict=True
        )
    )


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _lead(x):
    return x[None]


def _unstacked(tree: PyTree) -> PyTree:
    """A `STACKED` value as its rank sees it, inside a `per_rank` region."""
    return jax.tree.map(lambda x: x[0], tree)
