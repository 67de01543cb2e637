"""What block quantization means for the engine: the ops it calls, and the
wire format of a quantized tensor.

The numerics (symmetric absmax blocks, fp32 scales rounded to 16 significant
bits, int4 packed two per byte, non-finite blocks dequantizing to NaN) are
defined by `pallas_kernels`, whose ops run the Pallas kernels on NVIDIA GPUs
and the bit-identical plain-JAX reference elsewhere. This module re-exports
them under the names the engine uses.

Wire format: a quantized tensor travels as two collectives, one of the codes
(1 byte per element for int8, 1/2 for int4) and one of the scales (4 bytes
per block in fp32; gradients' scales travel in bf16 by default, 2 bytes).
`wire_bytes` counts both.
"""

from __future__ import annotations

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
    "pack_int4",
    "qmax",
    "quantize",
    "unpack_int4",
    "wire_bytes",
]


def wire_bytes(n: int, bits: int, block_size: int, scale_bytes: int = 4) -> int:
    """Bytes a quantized axis of `n` elements occupies on the wire (codes +
    scales of `scale_bytes` each: 4 for fp32, 2 for bf16)."""
    block = effective_block_size(n, block_size, bits)
    nb = num_blocks(n, block)
    return nb * block * bits // 8 + scale_bytes * nb
