"""Plain and quantized collectives over the (`node`, `local`) mesh.

Every function here runs *inside* `jax.shard_map` over a mesh built by
`zpp_jax.make_mesh` (or inside `jax.pmap` with one or both axis names) and
works on flat 1-D vectors. An axis name that is not bound counts as an axis of
size 1: under ``jax.pmap(..., axis_name="local")`` the devices form one node.
A device's primary shard is chunk ``node * local_size + local`` of the full
vector (node-major), which is exactly how a 1-D array sharded ``P(("node", "local"))`` is laid out.

Byte counts below are per device, with N = nodes x local devices, a full
vector of N*s elements and a shard of s elements.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels as kernels
from zpp_jax import quant
from zpp_jax.errors import UsageError
from zpp_jax.mesh import AXES, LOCAL, NODE


def axis_sizes() -> tuple[int, int]:
    """(nodes, local) of the enclosing shard_map or pmap (1 for an unbound axis)."""
    return _size(NODE), _size(LOCAL)


def axis_index(name: str):
    """This device's index along `name` (0 for an unbound axis)."""
    return lax.axis_index(name) if _size(name, check=False) else 0


def bound_axes() -> tuple[str, ...]:
    """The engine's axis names bound here, node first."""
    axes = tuple(a for a in AXES if _size(a, check=False))
    if not axes:
        raise UsageError(
            "no 'node' or 'local' axis is bound: call the engine inside jax.shard_map over a "
            "zpp_jax.make_mesh mesh, or inside jax.pmap with axis_name='local'"
        )
    return axes


def _size(name: str, check: bool = True) -> int:
    try:
        return lax.axis_size(name)
    except NameError:
        if check:
            bound_axes()
        return 1 if check else 0


def gather_rows(shard: jax.Array, comm_dtype=None, axes=None) -> jax.Array:
    """Every device's shard (s,) over `axes`, stacked: (N, s) in `comm_dtype`
    (default: the shard's dtype). Moves (N-1)*s elements of `comm_dtype`.

    The payload travels as raw bits (an unsigned int of the same width): left
    as floats, XLA may move the cast back to the wide dtype in front of the
    collective and send the wide dtype instead.
    """
    wire = shard if comm_dtype is None else shard.astype(comm_dtype)
    axes = bound_axes() if axes is None else axes
    return from_bits(lax.all_gather(to_bits(wire), axes), wire.dtype)


def all_gather(shard: jax.Array, comm_dtype=None) -> jax.Array:
    """Gather the full vector (N*s,) from every device's shard (s,).

    Moves (N-1)*s elements in `comm_dtype` (default: the shard's dtype). The
    result has the shard's dtype.
    """
    return gather_rows(shard, comm_dtype).reshape(-1).astype(shard.dtype)


def gather_all(x):
    """`x` (an array or a pytree of arrays) of every device, stacked in
    device order: (N, *shape) per array, one all-gather over every bound axis."""
    axes = bound_axes()
    return jax.tree.map(lambda a: lax.all_gather(a, axes), x)


def gather_over(x, axis: str):
    """`x` (an array or a pytree of arrays, e.g. `quant.QuantizedBlocks`) of
    every device along one mesh axis, stacked: (size, *shape) per array. An
    unbound axis or one of size 1 moves nothing. Send raw bits (`to_bits`)
    for narrow floats, so XLA cannot widen the wire."""
    if _size(axis, check=False) <= 1:
        return jax.tree.map(lambda a: a[None], x)
    return jax.tree.map(lambda a: lax.all_gather(a, axis), x)


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def to_bits(x: jax.Array) -> jax.Array:
    """The raw bits of `x` as unsigned integers of the same width."""
    return lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize])


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Inverse of `to_bits`."""
    return lax.bitcast_convert_type(x, dtype)


def _one_message(q: quant.QuantizedBlocks, lead: int, send, scale_dtype: str = "float32"):
    """`send` (a collective on one array) applied to `q` as one message of
    bytes (`quant.pack`: per index of the first `lead` axes, the codes then
    the scales in `scale_dtype`, which they are exact in), and what it
    returns unpacked under the leading axes it gives."""
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype), q)
    got = send(quant.pack(q, lead=lead, scale_dtype=scale_dtype))
    return quant.unpack(got, like.codes, like.scales, scale_dtype)


def _all_to_all(
    q: quant.QuantizedBlocks, axis: str, scale_dtype: str = "float32"
) -> quant.QuantizedBlocks:
    """Row j of codes and of scales to peer j along `axis` (tiled over the
    leading axis), as one message of bytes."""
    return _one_message(q, 1, lambda a: lax.all_to_all(a, axis, 0, 0, tiled=True), scale_dtype)


def _exchange(
    q: quant.QuantizedBlocks, axis: str, scale_dtype: str = "float32"
) -> quant.QuantizedBlocks:
    """What `_all_to_all` returns (row j from peer j along `axis`), sent as
    one collective-permute per peer distance: axis size - 1 messages of one
    row each, the bytes of the all-to-all (with 2 peers, one message).

    qgZ's step across nodes travels this way. XLA:GPU's scheduler keeps at
    most one collective of each kind in flight: as a permute, this step
    does not queue behind the intra-node all-to-all of the next layer's
    reduction, and with the engine's options (`zpp_jax.overlap`) each runs
    behind compute."""
    return _one_message(q, 1, lambda a: _permute_rows(a, axis), scale_dtype)


def _permute_rows(a: jax.Array, axis: str) -> jax.Array:
    k = a.shape[0]
    me = lax.axis_index(axis)
    own = lax.dynamic_index_in_dim(a, me, 0, keepdims=False)
    out = lax.dynamic_update_index_in_dim(jnp.zeros_like(a), own, me, 0)
    for d in range(1, k):
        row = lax.dynamic_index_in_dim(a, (me + d) % k, 0, keepdims=False)
        got = lax.ppermute(row, axis, [(j, (j + d) % k) for j in range(k)])
        out = lax.dynamic_update_index_in_dim(out, got, (me - d) % k, 0)
    return out


def quantized_gather(shard: jax.Array, bits: int, block_size: int) -> quant.QuantizedBlocks:
    """qwZ: quantize this device's shard (s,) and all-gather it over every
    device, still quantized: codes (N, nb, block_bytes) and fp32 scales
    (N, nb), row d from device d.

    Moves (N-1) * quant.wire_bytes(s) bytes: s (int8) or s/2 (int4) bytes per
    peer plus 4 bytes per block, against 4s for fp32 or 2s for bf16, as one
    collective of bytes (codes, then scales: each device's codes stay one
    contiguous run).
    """
    axes = bound_axes()
    q = kernels.quantize(shard, bits, block_size)
    return _one_message(q, 0, lambda a: lax.all_gather(a, axes))


def quantized_all_gather(
    shard: jax.Array, bits: int, block_size: int, dtype=jnp.float32
) -> jax.Array:
    """qwZ all-gather: the full vector (N*s,) in `dtype`, each element within
    half a quantization step of the original."""
    q = quantized_gather(shard, bits, block_size)
    return kernels.dequantize(q, bits, shard.shape[0], dtype).reshape(-1)


def reduce_scatter(full: jax.Array, comm_dtype=None, mean: bool = True) -> jax.Array:
    """Baseline gradient reduction: the mean (or, with ``mean=False``, the
    sum) over all N devices of `full` (N*s,), scattered so each device keeps
    its own shard (s,) in fp32.

    Moves (N-1)*s elements of `comm_dtype` (default fp32) per device. In fp32
    this is XLA's reduce-scatter. In a narrower dtype it is an all-to-all of
    the narrow values (raw bits, so XLA cannot widen the wire) followed by an
    fp32 sum: the same bytes as a ring reduce-scatter in that dtype, with fp32
    accumulation instead of rounding at every hop.
    """
    if comm_dtype is None or jnp.dtype(comm_dtype) == jnp.float32:
        summed = lax.psum_scatter(
            full.astype(jnp.float32), bound_axes(), scatter_dimension=0, tiled=True
        )
        return _mean(summed, mean)
    nodes, local = axis_sizes()
    rows = to_bits(full.astype(comm_dtype).reshape(nodes * local, -1))
    received = from_bits(lax.all_to_all(rows, bound_axes(), 0, 0, tiled=True), comm_dtype)
    # Row by row, left to right: one fused elementwise pass. (XLA:CPU runs
    # jnp.sum over the leading axis as a strided reduction, 30x slower.)
    total = received[0].astype(jnp.float32)
    for row in range(1, nodes * local):
        total = total + received[row].astype(jnp.float32)
    return _mean(total, mean)


def _mean(summed: jax.Array, mean: bool = True) -> jax.Array:
    # The one place both gradient paths divide by the device count, so the
    # quantized and the plain reduction average identically.
    if not mean:
        return summed
    nodes, local = axis_sizes()
    return summed * jnp.float32(1.0 / (nodes * local))


def residual_size(shard_size: int, nodes: int, local: int) -> int:
    """Elements of the error-feedback residual one device keeps for one vector:
    the full local gradient (N*s) plus the intra-node partial sum (nodes*s)."""
    return (nodes * local + nodes) * shard_size


def hierarchical_reduce_scatter(
    full: jax.Array | quant.QuantizedBlocks,
    bits: int,
    block_size: int,
    residual: jax.Array | None = None,
    mean: bool = True,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
    before_node_step: Callable[[quant.QuantizedBlocks], None] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """qgZ: quantized hierarchical reduction of `full` (N*s,) to this device's
    shard (s,) of the mean (or, with ``mean=False``, the sum) over all N
    devices, in fp32.

    Steps: quantize with the slice reordering fused in (the chunks each local
    peer reduces become contiguous; each chunk of s elements has its own
    blocks); all-to-all over `local`; one fused kernel dequantizes what
    arrived, sums it in fp32 and requantizes it with the same blocks;
    an exchange over `node` on 1/local of the data (the bytes of an
    all-to-all, as nodes-1 collective-permutes: see `_exchange`); dequantize
    and sum in fp32.
    A step over an axis of size 1 moves nothing and is skipped, quantization
    included. Both quantizations round as `rounding` says ("nearest" or
    "stochastic") and make scales exact in `scale_dtype`, the dtype they
    travel in ("float32" or "bfloat16": 4 or 2 bytes a block; see
    `pallas_kernels.quantize`).

    Bytes per device: (local-1)/local * N*s*bits/8 inside the node and
    (nodes-1)/nodes * nodes*s*bits/8 across nodes, plus 4 (fp32) or 2 (bf16)
    bytes per block of scales: with int4, about 1/(8*local) of what an fp32
    reduce-scatter sends across nodes.

    With `residual` (shape ``(residual_size(s, nodes, local),)``), the error of
    each quantization is added back before the same quantization next call
    (error feedback); returns the updated residual in the residual's dtype,
    else None. Each quantization adds and updates its part of the residual
    in the same kernel (`pallas_kernels.quantize_reordered_with_feedback`,
    `pallas_kernels.dequantize_sum_quantize`): one more read and write of
    the residual, no pass over the gradient of its own.

    `before_node_step`, if given, is called (while tracing) with the
    blocks about to cross nodes, once the step inside the node has made
    them: a caller can order other work after that step
    (`ShardedLayer.relayed` does). Not called on one node.

    `full` may also be given already quantized, as the blocks of
    ``quantize(full, bits, block_size)`` (codes (N*nb, ...), scales (N*nb,);
    block_size must divide s): for example quantized tensor by tensor, as
    `ShardedLayer` does, so that the fp32 vector is never assembled. The
    result is bit-identical. Not with `residual`, which needs the fp32 values.
    """
    nodes, local = axis_sizes()
    n = nodes * local
    if isinstance(full, quant.QuantizedBlocks):
        blocks, s = full, _blocks_shard_size(full, n, bits, block_size, residual)
    else:
        blocks, s = None, _vector_shard_size(full, n)
        full = full.astype(jnp.float32)
    r_local, r_node = _split_residual(residual, s, nodes, local)
    kw = dict(rounding=rounding, scale_dtype=scale_dtype)
    if local > 1:
        q, r_local = _chunks_for_local_peers(
            full, blocks, r_local, nodes, local, bits, block_size, kw
        )
        arrived = _all_to_all(q, LOCAL, scale_dtype)
        if nodes == 1:
            return _mean(_dequantize_sum(arrived, bits, s)[0], mean), _pack_residual(
                residual, r_local, r_node
            )
        q, r_node = kernels.dequantize_sum_quantize(arrived, bits, s, r_node, **kw)
    else:
        q, r_node = _chunks_for_nodes(full, blocks, r_node, nodes, s, bits, block_size, kw)
    if nodes > 1:
        if before_node_step is not None:
            before_node_step(q)
        arrived = _exchange(q, NODE, scale_dtype)
        shard = _dequantize_sum(arrived, bits, s)
    else:  # a 1 x 1 mesh: nothing to reduce
        shard = kernels.dequantize(q, bits, s)[0]
    return _mean(shard, mean), _pack_residual(residual, r_local, r_node)


def _chunks_for_local_peers(full, blocks, r_local, nodes, local, bits, block_size, kw):
    """The quantized chunks, row [l, m] = chunk m*local + l: what local peer
    l reduces for node m; and the new residual of this step (or None)."""
    if blocks is not None:
        return jax.tree.map(lambda a: _chunk_rows(a, nodes, local).swapaxes(0, 1), blocks), None
    if r_local is None:
        return kernels.quantize_reordered(full, nodes, local, bits, block_size, **kw), None
    return kernels.quantize_reordered_with_feedback(
        full, r_local, nodes, local, bits, block_size, **kw
    )


def _chunks_for_nodes(full, blocks, r_node, nodes, s, bits, block_size, kw):
    """With one device per node: the quantized chunk for each node, and the
    new residual of the step across nodes (or None)."""
    if blocks is not None:
        return jax.tree.map(lambda a: _chunk_rows(a, nodes, 1)[:, 0], blocks), r_node
    rows = full.reshape(nodes, s)
    if r_node is not None:
        rows = rows + r_node
    q = kernels.quantize(rows, bits, block_size, **kw)
    if r_node is not None:
        r_node = rows - kernels.dequantize(q, bits, s)
    return q, r_node


def _blocks_shard_size(
    blocks: quant.QuantizedBlocks, n: int, bits: int, block_size: int, residual
) -> int:
    """The shard size of a vector given as its quantized blocks; raises
    UsageError unless they are the blocks of a whole vector of `n` shards."""
    nb_total = blocks.scales.shape[0]
    if blocks.scales.ndim != 1 or nb_total % n:
        raise UsageError(
            "hierarchical_reduce_scatter needs quantized blocks of the whole vector, "
            f"scales of shape (N*nb,) with N = {n} devices, got {blocks.scales.shape}"
        )
    if residual is not None:
        raise UsageError(
            "error feedback needs the fp32 gradient: pass `full` unquantized with a residual"
        )
    codes_shape = (nb_total, block_size * bits // 8)
    if blocks.codes.shape != codes_shape:
        raise UsageError(
            f"quantized blocks have codes of shape {blocks.codes.shape}, expected "
            f"{codes_shape} for {bits}-bit blocks of {block_size}"
        )
    return nb_total // n * block_size


def _vector_shard_size(full: jax.Array, n: int) -> int:
    if full.ndim != 1 or full.shape[0] % n:
        raise UsageError(
            "hierarchical_reduce_scatter needs a 1-D vector whose length is a multiple of "
            f"the {n} devices, got shape {full.shape}"
        )
    return full.shape[0] // n


def _split_residual(residual, s: int, nodes: int, local: int):
    """(The residual of the step inside the node (local, nodes, s), of the
    step across nodes (nodes, s)), in fp32; (None, None) without one."""
    if residual is None:
        return None, None
    n = nodes * local
    if residual.shape != (residual_size(s, nodes, local),):
        raise UsageError(
            f"residual has shape {residual.shape}, expected ({residual_size(s, nodes, local)},)"
        )
    r_local = residual[: n * s].reshape(local, nodes, s).astype(jnp.float32)
    r_node = residual[n * s :].reshape(nodes, s).astype(jnp.float32)
    return r_local, r_node


def _chunk_rows(a: jax.Array, nodes: int, local: int) -> jax.Array:
    """Blocks of the whole vector (N*nb, ...) -> (nodes, local, nb, ...): one
    row per device's chunk (chunk node*local + l, node-major)."""
    return a.reshape(nodes, local, -1, *a.shape[1:])


def _dequantize_sum(q: quant.QuantizedBlocks, bits: int, size: int) -> jax.Array:
    """Sum over the leading axis of dequantized blocks, in fp32, left to right."""
    parts = kernels.dequantize(q, bits, size)
    total = parts[0]
    for j in range(1, parts.shape[0]):
        total = total + parts[j]
    return total


def _pack_residual(residual, r_local, r_node):
    if residual is None:
        return None
    pieces = [r.reshape(-1) for r in (r_local, r_node)]
    return jnp.concatenate(pieces).astype(residual.dtype)
