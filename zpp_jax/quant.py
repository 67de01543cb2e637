"""What block quantization means for the engine: the ops it calls, and the
wire format of a quantized tensor.

The numerics (symmetric absmax blocks, fp32 scales rounded to 16 significant
bits, int4 packed two per byte, non-finite blocks dequantizing to NaN) are
defined by `pallas_kernels`, whose ops run the Pallas kernels on NVIDIA GPUs
and the bit-identical plain-JAX reference elsewhere. This module re-exports
them under the names the engine uses.

Wire format: a quantized tensor travels as two collectives, one of the codes
(1 byte per element for int8, 1/2 for int4) and one of the fp32 scales (4
bytes per block). `wire_bytes` counts both.
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


def wire_bytes(n: int, bits: int, block_size: int) -> int:
    """Bytes a quantized axis of `n` elements occupies on the wire (codes + fp32 scales)."""
    block = effective_block_size(n, block_size, bits)
    nb = num_blocks(n, block)
    return nb * block * bits // 8 + 4 * nb
