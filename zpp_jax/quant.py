"""What block quantization means for the engine: the ops it calls, and the
wire format of a quantized tensor.

The numerics (symmetric absmax blocks, fp32 scales rounded to 16 significant
bits, int4 packed two per byte, non-finite blocks dequantizing to NaN) are
defined by `pallas_kernels`, whose ops run the Pallas kernels on NVIDIA GPUs
and the bit-identical plain-JAX reference elsewhere. This module re-exports
them under the names the engine uses.

Wire format: a quantized tensor travels as one collective of bytes
(`pack`): per peer, its codes (1 byte per element for int8, 1/2 for int4)
followed by the raw bytes of its scales (4 per block in fp32; gradients'
scales travel in bf16 by default, 2 bytes). One message instead of two
halves the collectives a scheduler has to place behind compute and the
latency paid per step. `wire_bytes` counts both parts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import (
    FLOAT_DTYPES,
    SUPPORTED_BITS,
    QuantizedBlocks,
    dequantize,
    effective_block_size,
    num_blocks,
    pack_int4,
    qmax,
    quantize,
    unpack_int4,
)

__all__ = [
    "FLOAT_DTYPES",
    "SUPPORTED_BITS",
    "QuantizedBlocks",
    "dequantize",
    "effective_block_size",
    "num_blocks",
    "pack",
    "pack_int4",
    "qmax",
    "quantize",
    "unpack",
    "unpack_int4",
    "wire_bytes",
]


def wire_bytes(n: int, bits: int, block_size: int, scale_bytes: int = 4) -> int:
    """Bytes a quantized axis of `n` elements occupies on the wire (codes +
    scales of `scale_bytes` each: 4 for fp32, 2 for bf16)."""
    block = effective_block_size(n, block_size, bits)
    nb = num_blocks(n, block)
    return nb * block * bits // 8 + scale_bytes * nb


def pack(q: QuantizedBlocks, lead: int = 0, scale_dtype="float32") -> jax.Array:
    """`q` as one uint8 array for the wire: for each index of its first
    `lead` axes, the codes' bytes then the bytes of the scales (cast to
    `scale_dtype`, which they must be exact in). Costs one copy of the
    codes; the inverse is `unpack`."""
    head = q.codes.shape[:lead]
    codes = q.codes.reshape(head + (-1,))
    if codes.dtype != jnp.uint8:
        codes = lax.bitcast_convert_type(codes, jnp.uint8)
    scales = lax.bitcast_convert_type(q.scales.astype(scale_dtype), jnp.uint8)
    return jnp.concatenate([codes, scales.reshape(head + (-1,))], axis=-1)


def unpack(
    buf: jax.Array, codes_like: jax.Array, scales_like: jax.Array, scale_dtype="float32"
) -> QuantizedBlocks:
    """`pack`'s inverse on a buffer whose leading axes may differ from the
    packed ones (gathered or exchanged: rows of peers): codes shaped like
    `codes_like`'s trailing axes and dtype, fp32 scales shaped like
    `scales_like`'s, each under `buf`'s leading axes. `codes_like` and
    `scales_like` give the per-peer shapes (arrays or ShapeDtypeStructs)."""
    item = jnp.dtype(scale_dtype).itemsize
    width = scales_like.size * item
    head = buf.shape[:-1]
    codes = buf[..., : buf.shape[-1] - width]
    if codes_like.dtype != jnp.uint8:
        codes = lax.bitcast_convert_type(codes, codes_like.dtype)
    scale_bytes = buf[..., buf.shape[-1] - width :]
    scales = lax.bitcast_convert_type(scale_bytes.reshape(head + (-1, item)), scale_dtype)
    return QuantizedBlocks(
        codes.reshape(head + codes_like.shape),
        scales.astype(jnp.float32).reshape(head + scales_like.shape),
    )
