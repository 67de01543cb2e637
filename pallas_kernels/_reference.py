"""Plain-JAX references of the kernel ops, built on `zpp_jax.quant` (which
defines the numerics). The kernels must match these bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zpp_jax import quant
from zpp_jax.quant import QuantizedBlocks


def quantize(x: jax.Array, bits: int, block_size: int) -> QuantizedBlocks:
    return quant.quantize(x, bits, block_size)


def dequantize(q: QuantizedBlocks, bits: int, size: int, dtype) -> jax.Array:
    return quant.dequantize(q, bits, size, dtype)


def block_of(q: QuantizedBlocks, bits: int) -> int:
    """The (effective) block size quantized blocks were made with."""
    return q.codes.shape[-1] * (2 if bits == 4 else 1)


def dequantize_sum_quantize(
    q: QuantizedBlocks, bits: int, size: int, residual: jax.Array | None
) -> tuple[QuantizedBlocks, jax.Array | None]:
    """Sum over the leading axis of the dequantized inputs, left to right in
    fp32, plus `residual`; requantize with the same blocks; the new residual is
    what the requantization lost."""
    total = None
    for j in range(q.codes.shape[0]):
        part = quant.dequantize(QuantizedBlocks(q.codes[j], q.scales[j]), bits, size)
        total = part if total is None else total + part
    if residual is not None:
        total = total + residual.astype(jnp.float32)
    out = quant.quantize(total, bits, block_of(q, bits))
    new = None if residual is None else total - quant.dequantize(out, bits, size)
    return out, new


def quantize_reordered(
    full: jax.Array, nodes: int, local: int, bits: int, block_size: int
) -> QuantizedBlocks:
    """quantize(full.reshape(nodes, local, s).swapaxes(0, 1)): blocks of shape
    (local, nodes, nb, ...), row [l, n] = chunk n*local + l of `full`."""
    s = full.shape[-1] // (nodes * local)
    # Each chunk is a row with its own blocks either way, so quantizing in
    # place and swapping the chunk axes of codes and scales gives the same
    # bits, and the swap moves 1/8 (int4) of the bytes of the fp32 input.
    q = quant.quantize(full.reshape(nodes, local, s), bits, block_size)
    return jax.tree.map(lambda a: a.swapaxes(0, 1), q)
