"""How a unit's parameters are cut into per-device shards: two layouts.

Both describe a per-device vector of s elements (what one device sends when
the unit's weights are gathered, and receives when its gradient is reduced)
and how the N devices' vectors, stacked as rows (N, s), map back to the
parameter pytree:

* `FlatLayout`: all leaves of a pytree concatenated into one flat fp32
  vector, padded to a multiple of N and cut into N contiguous shards; the
  shards are the stored parameters (the low-level engine API).
* `ParamLayout`: every parameter keeps its own shape and dtype and is split
  evenly along one of its dimensions (per-parameter sharding, what
  `zpp_jax.shard` stores); the per-device vector concatenates this device's
  blocks of all of them.

One unit costs one collective per direction, whatever its number of leaves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax import quant
from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.mesh import AXES, mesh_shape, whole_on

PyTree = Any


def _quantize_flat_blocks(
    layout: FlatLayout, tree: PyTree, bits: int, block: int, rounding: str, scale_dtype: str
) -> quant.QuantizedBlocks:
    """``quantize(layout.flatten(tree), bits, block)`` bit for bit, computed
    tensor by tensor: codes (N*s/block, ...) and scales (N*s/block,). Needs
    every leaf offset and the shard size to be multiples of `block`
    (``layout.align % block == 0``); alignment gaps and padding are zero
    blocks (scale 0, codes 0), which is what quantizing zeros gives."""
    codes, scales, end = [], [], 0
    code_dtype = jnp.uint8 if bits == 4 else jnp.int8

    def zero_blocks(count):
        codes.append(jnp.zeros((count, block * bits // 8), code_dtype))
        scales.append(jnp.zeros((count,), jnp.float32))

    for leaf, offset in zip(layout.treedef.flatten_up_to(tree), layout.offsets, strict=True):
        if offset > end:
            zero_blocks((offset - end) // block)
        x = jnp.ravel(leaf)  # the kernel reads it in fp32: no widened copy
        count = -(-x.size // block)
        if count == 0:
            continue
        x = jnp.pad(x, (0, count * block - x.size))
        q = quant.quantize(
            x.reshape(count, block), bits, block, rounding=rounding, scale_dtype=scale_dtype
        )
        codes.append(q.codes.reshape(count, -1))
        scales.append(q.scales.reshape(count))
        end = offset + count * block
    if layout.padded_size > end:
        zero_blocks((layout.padded_size - end) // block)
    return quant.QuantizedBlocks(jnp.concatenate(codes), jnp.concatenate(scales))


def _quantize_rows_by_tensor(
    layout: ParamLayout, tree: PyTree, bits: int, block: int, rounding: str, scale_dtype: str
) -> quant.QuantizedBlocks:
    """``quantize(layout.flatten_rows(tree).reshape(-1), bits, block)`` bit
    for bit, tensor by tensor: each parameter's rows (N, its block size) are
    quantized on their own and the blocks interleaved per device. Rows of at
    most `_SHORT_ROW` elements (biases, norm scales) are quantized together,
    in one call, as the pieces of one array: copying them costs less than a
    call each. Needs the offsets and the shard size to be multiples of
    `block`."""
    n, code_dtype = layout.num_shards, jnp.uint8 if bits == 4 else jnp.int8
    leaves = layout.treedef.flatten_up_to(tree)

    def blocks_of(i):
        k = layout.slices[i][1]
        count = -(-k // block)
        x = jnp.pad(layout.device_rows(leaves[i], i), ((0, 0), (0, count * block - k)))
        return x.reshape(n, count, block)

    def quantize(x):
        q = quant.quantize(x, bits, block, rounding=rounding, scale_dtype=scale_dtype)
        return q.codes, q.scales

    short = [i for i in layout.order if layout.slices[i][1] <= _SHORT_ROW]
    pieces = {i: quantize(blocks_of(i)) for i in layout.order if i not in short}
    if short:
        parts = [blocks_of(i) for i in short]
        codes, scales = quantize(jnp.concatenate(parts, axis=1))
        start = 0
        for i, part in zip(short, parts, strict=True):
            count = part.shape[1]
            pieces[i] = codes[:, start : start + count], scales[:, start : start + count]
            start += count

    codes, scales, end = [], [], 0

    def zero_blocks(count):
        codes.append(jnp.zeros((n, count, block * bits // 8), code_dtype))
        scales.append(jnp.zeros((n, count), jnp.float32))

    for i in layout.order:
        off, k = layout.slices[i]
        if off > end:
            zero_blocks((off - end) // block)
        codes.append(pieces[i][0])
        scales.append(pieces[i][1])
        end = off + -(-k // block) * block
    if layout.shard_size > end:
        zero_blocks((layout.shard_size - end) // block)
    c, s = jnp.concatenate(codes, axis=1), jnp.concatenate(scales, axis=1)
    return quant.QuantizedBlocks(c.reshape(-1, c.shape[-1]), s.reshape(-1))


# Elements per device below which a parameter's gradient rows are quantized
# together with the other short ones (1 KiB of fp32 per device and tensor).
_SHORT_ROW = 256


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

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) pieces of the per-device vector that are quantized
        on their own: the whole shard (leaves aligned with `align` keep
        quantization blocks inside one tensor)."""
        return ((0, self.shard_size),)

    def unflatten_rows(self, rows: jax.Array, dtype=None) -> PyTree:
        """The pytree from every device's shard, stacked as rows (N, s)."""
        return self.unflatten(rows.reshape(-1), dtype)

    def from_segments(self, values, dtype=None) -> PyTree:
        """The pytree from every device's one segment (N, s), `values[0]`."""
        return self.unflatten_rows(values[0], dtype)

    def flatten_rows(self, tree: PyTree) -> jax.Array:
        """fp32 rows (N, s): row d is what device d holds of `tree`."""
        return self.flatten(tree).reshape(self.num_shards, self.shard_size)

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

    quantize_gradient = _quantize_flat_blocks

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


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Per-parameter sharding of one unit's parameters, as one call sees them.

    Parameter i (shape `shapes[i]`) is split evenly along dimension `dims[i]`
    into N blocks; device d holds block d. The per-device vector (s,)
    concatenates this device's blocks, flattened, block i starting at
    `offsets[i]`. Blocks whose size is a multiple of `weight_block` come
    first, back to back (whole quantization blocks, so they are quantized
    together); every other block starts at a multiple of `align` (so that
    gradient quantization blocks never straddle two tensors). With
    ``dims[i] == 0`` a block is a contiguous run of the parameter, and
    reassembling it from the rows is a reshape.

    Memory kept per device: 1/N of each parameter, in its own dtype.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    dims: tuple[int, ...]
    offsets: tuple[int, ...]
    num_shards: int
    shard_size: int
    align: int = 1
    whole: int = 0  # length of the leading run of whole weight blocks

    @classmethod
    def from_tree(
        cls, tree: PyTree, dims, num_shards: int, align: int = 1, weight_block: int | None = None
    ) -> ParamLayout:
        """Layout of `tree` (arrays or shape/dtype structs) split along `dims`
        (one per leaf, each dividing its dimension by `num_shards`)."""
        leaves, treedef = jax.tree.flatten(tree)
        dims = tuple(dims)
        if len(dims) != len(leaves):
            raise UsageError(f"{len(leaves)} parameters but {len(dims)} shard dimensions")
        sizes = []
        for leaf, dim in zip(leaves, dims, strict=True):
            shape = tuple(np.shape(leaf))
            if not 0 <= dim < len(shape) or shape[dim] % num_shards:
                raise UsageError(
                    f"cannot split a parameter of shape {shape} along dimension {dim} over "
                    f"{num_shards} devices"
                )
            sizes.append(math.prod(shape) // num_shards)
        grouped = weight_block is not None and weight_block % align == 0
        whole = [grouped and k % weight_block == 0 for k in sizes]
        offsets, end = [0] * len(sizes), 0
        for i in [i for i, w in enumerate(whole) if w] + [i for i, w in enumerate(whole) if not w]:
            offsets[i] = end
            end += -(-sizes[i] // align) * align
        return cls(
            treedef,
            tuple(tuple(np.shape(x)) for x in leaves),
            tuple(jnp.dtype(jnp.result_type(x)) for x in leaves),
            dims,
            tuple(offsets),
            num_shards,
            max(end, align),
            align,
            sum(k for k, w in zip(sizes, whole, strict=True) if w),
        )

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        n = self.num_shards
        return tuple(
            s[:d] + (s[d] // n,) + s[d + 1 :] for s, d in zip(self.shapes, self.dims, strict=True)
        )

    @property
    def slices(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of each parameter's block in the per-device vector."""
        return tuple(
            (off, math.prod(b)) for off, b in zip(self.offsets, self.block_shapes, strict=True)
        )

    @property
    def order(self) -> tuple[int, ...]:
        """Parameter indices in the order their blocks lie in the vector."""
        return tuple(sorted(range(len(self.offsets)), key=self.offsets.__getitem__))

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) pieces of the per-device vector that are quantized
        on their own: the run of whole weight blocks, then each other
        parameter's block. No quantization block mixes two tensors, and no
        padding travels."""
        rest = [self.slices[i] for i in self.order if self.slices[i][0] >= self.whole]
        return (((0, self.whole),) if self.whole else ()) + tuple(rest)

    def pack(self, blocks: PyTree) -> jax.Array:
        """This device's blocks (a pytree like the parameters, each of its
        block shape) -> the per-device fp32 vector (s,). Traceable; its
        transpose hands each block its part of the vector's cotangent."""
        leaves = self.treedef.flatten_up_to(blocks)
        parts, end = [], 0
        for i in self.order:
            off, k = self.slices[i]
            if off > end:
                parts.append(jnp.zeros((off - end,), jnp.float32))
            parts.append(jnp.ravel(leaves[i]).astype(jnp.float32))
            end = off + k
        if self.shard_size > end:
            parts.append(jnp.zeros((self.shard_size - end,), jnp.float32))
        return jnp.concatenate(parts)

    def from_segments(self, values, dtype=None) -> PyTree:
        """Full parameters from every device's pieces of its vector:
        `values[start]` is (N, length) from offset `start`, a segment or
        finer (a tensor's own block, which then takes no slice)."""
        n, leaves = self.num_shards, []
        for (off, k), shape, block, dim, dt in zip(
            self.slices, self.shapes, self.block_shapes, self.dims, self.dtypes, strict=True
        ):
            j = max(start for start in values if start <= off)
            v = values[j][:, off - j : off - j + k].reshape((n,) + block)
            if dim:
                v = jnp.moveaxis(v, 0, dim)
            leaves.append(v.reshape(shape).astype(dt if dtype is None else dtype))
        return self.treedef.unflatten(leaves)

    def unflatten_rows(self, rows: jax.Array, dtype=None) -> PyTree:
        """Full parameters from every device's vector, stacked as rows (N, s)."""
        return self.from_segments({o: rows[:, o : o + k] for o, k in self.segments}, dtype)

    def device_rows(self, leaf: jax.Array, i: int) -> jax.Array:
        """(N, block size) in the leaf's dtype: its block of every device."""
        shape, dim, n = leaf.shape, self.dims[i], self.num_shards
        x = leaf.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1 :])
        return jnp.moveaxis(x, dim, 0).reshape(n, self.slices[i][1])

    def flatten_rows(self, tree: PyTree) -> jax.Array:
        """fp32 rows (N, s): row d is device d's vector of `tree` (e.g. a
        gradient: what the reduction delivers to device d)."""
        leaves = self.treedef.flatten_up_to(tree)
        n, rows, end = self.num_shards, [], 0
        for i in self.order:
            off, k = self.slices[i]
            if off > end:
                rows.append(jnp.zeros((n, off - end), jnp.float32))
            rows.append(self.device_rows(leaves[i], i).astype(jnp.float32))
            end = off + k
        if self.shard_size > end:
            rows.append(jnp.zeros((n, self.shard_size - end), jnp.float32))
        return jnp.concatenate(rows, axis=1)

    quantize_gradient = _quantize_rows_by_tensor


class Layout(Protocol):
    """What the engine needs of a layout: where a unit's parameters live in
    each device's (s,) vector, and the way back. `FlatLayout` and
    `ParamLayout` implement it; `ShardedLayer` takes either."""

    treedef: Any
    num_shards: int
    shard_size: int
    align: int

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of each contiguous run of one tensor in the vector."""

    def flatten_rows(self, tree: PyTree) -> jax.Array:
        """fp32 rows (N, s): row d is device d's vector of `tree`."""

    def unflatten_rows(self, rows: jax.Array, dtype=None) -> PyTree:
        """The full parameters from every device's vector, stacked as rows."""

    def from_segments(self, values, dtype=None) -> PyTree:
        """The full parameters from each segment's rows, by its offset."""

    def quantize_gradient(
        self, tree: PyTree, bits: int, block: int, rounding: str, scale_dtype: str
    ) -> quant.QuantizedBlocks:
        """The blocks of ``flatten_rows(tree)`` quantized, bit for bit, tensor
        by tensor (needs ``align % block == 0``)."""


def call_layout(config: ZeroPPConfig, params: list[tuple], n: int) -> ParamLayout:
    """The per-device layout of one call's split parameters, given as
    (shape, dtype, split dimension)."""
    return ParamLayout.from_tree(
        [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in params],
        [dim for _, _, dim in params],
        n,
        config.grad_block if config.quantize_gradients else 1,
        config.block_size if config.quantize_weights else None,
    )


def quant_float_dtypes():
    return [jnp.dtype(d) for d in quant.FLOAT_DTYPES]


def primary_spec(stacked: bool = False) -> P:
    """PartitionSpec of a primary-shard array: its flat axis over (`node`, `local`)."""
    return P(None, AXES) if stacked else P(AXES)


def to_primary_shards(
    tree: PyTree, mesh: Mesh, stacked: bool = False, align: int = 1
) -> tuple[jax.Array, FlatLayout]:
    """Flatten, pad and shard a pytree onto `mesh`.

    Returns the fp32 primary-shard array, shape (N*s,) (or (layers, N*s) when
    `stacked`) sharded so each device holds s (or layers x s) elements, and the
    layout to undo it. Pass ``align=config.alignment`` so that quantization
    blocks never straddle two tensors. Memory kept: 4 bytes per parameter over N devices
    (while it runs, the whole vector on every device).
    """
    nodes, local = mesh_shape(mesh)
    layout = FlatLayout.from_tree(tree, nodes * local, stacked=stacked, align=align)
    flatten = whole_on(mesh, jax.vmap(layout.flatten) if stacked else layout.flatten)
    out = NamedSharding(mesh, primary_spec(stacked))
    return jax.jit(flatten, out_shardings=out)(tree), layout


def from_primary_shards(shards: jax.Array, layout: FlatLayout, stacked: bool = False) -> PyTree:
    """The original pytree (original dtypes) from primary shards, for export
    and inspection. Gathers the whole model onto every device."""
    unflatten = jax.vmap(layout.unflatten) if stacked else layout.unflatten
    return jax.jit(whole_on(shards.sharding.mesh, unflatten))(shards)
