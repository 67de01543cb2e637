"""The middle step of the hierarchical gradient reduction, fused:
dequantize k inputs, sum them in fp32, add the error-feedback residual,
requantize."""

from __future__ import annotations

import functools

import jax

from pallas_kernels import _reference, _triton
from pallas_kernels._dispatch import by_platform
from pallas_kernels._reference import QuantizedBlocks


def dequantize_sum_quantize(
    q: QuantizedBlocks,
    bits: int,
    size: int,
    residual: jax.Array | None = None,
    *,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
    interpret: bool = False,
) -> tuple[QuantizedBlocks, jax.Array | None]:
    """`q` holds k quantized inputs stacked on a leading axis (codes
    ``(k, ..., nb, c)``); returns their fp32 sum (left to right, plus
    `residual` of shape ``(..., size)`` if given) requantized with the same
    blocks (`rounding` and `scale_dtype` as in `quantize`), and the new residual (fp32: what
    the requantization lost) or None.

    One pass: reads k x (codes + scales) and the residual, writes one set of
    codes + scales and the residual; the fp32 sum never leaves the chip.
    """
    _reference.check_bits(bits)
    _reference.check_rounding(rounding)
    _reference.check_scale_dtype(scale_dtype)
    return _dequantize_sum_quantize(q, residual, bits, size, rounding, scale_dtype, interpret)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _dequantize_sum_quantize(q, residual, bits, size, rounding, scale_dtype, interpret):
    # Under jit, tracing both backends happens once per shape, not per call.
    return by_platform(
        lambda q, residual, interpret: _triton.dequantize_sum_quantize(
            q, bits, size, residual, interpret, rounding, scale_dtype
        ),
        lambda q, residual: _reference.dequantize_sum_quantize(
            q, bits, size, residual, rounding, scale_dtype
        ),
        interpret,
        q,
        residual,
    )
