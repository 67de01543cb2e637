"""Block-quantization kernels: one public function per op, dispatched by
platform (Pallas/Triton on NVIDIA GPUs, the plain-JAX reference elsewhere;
``interpret=True`` runs the Pallas kernel itself on any platform): when the
program is traced over a mesh of CPU devices, else when it is lowered.

The package stands alone. `reference` (``_reference.py``) defines the numerics
and holds the plain-JAX reference of every op; every kernel matches it bit for
bit (codes and scales), NaN and Inf included: a block holding a non-finite
value gets an Inf scale and zero codes, so it dequantizes to NaN.

Each op lives in its own module (``quantize.py``, ``dequantize.py``,
``requantize.py``, ``reorder.py``), with the kernels in ``_triton.py``.
"""

from pallas_kernels import _reference as reference
from pallas_kernels._reference import (
    FLOAT_DTYPES,
    ROUNDINGS,
    SCALE_DTYPES,
    SUPPORTED_BITS,
    QuantizedBlocks,
    effective_block_size,
    num_blocks,
    pack_int4,
    qmax,
    unpack_int4,
)
from pallas_kernels.dequantize import dequantize, dequantize_runs
from pallas_kernels.quantize import quantize
from pallas_kernels.reorder import quantize_reordered, quantize_reordered_with_feedback
from pallas_kernels.requantize import dequantize_sum_quantize

__all__ = [
    "FLOAT_DTYPES",
    "ROUNDINGS",
    "SCALE_DTYPES",
    "SUPPORTED_BITS",
    "QuantizedBlocks",
    "dequantize",
    "dequantize_runs",
    "dequantize_sum_quantize",
    "effective_block_size",
    "num_blocks",
    "pack_int4",
    "qmax",
    "quantize",
    "quantize_reordered",
    "quantize_reordered_with_feedback",
    "reference",
    "unpack_int4",
]
