"""Block quantization: `quantize` (API) over `_triton` (kernel) and `_reference`."""

from __future__ import annotations

import functools

import jax

from pallas_kernels import _reference, _triton
from pallas_kernels._dispatch import by_platform
from pallas_kernels._reference import QuantizedBlocks


def quantize(
    x: jax.Array,
    bits: int,
    block_size: int,
    *,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
    interpret: bool = False,
) -> QuantizedBlocks:
    """Block-quantize `x` along its last axis, exactly as the reference `quantize`
    (codes and scales bit for bit). `rounding`: "nearest" (half to even) or
    "stochastic" (unbiased; see `reference.dither`). `scale_dtype`: the
    dtype the scales are exact in ("float32": 16 significant bits,
    "bfloat16": 8), returned as fp32 either way.

    Reads the input once and writes 1 (int8) or 1/2 (int4) byte per element
    plus 4 bytes per block.
    """
    _reference.check_float(x.dtype, "quantize")
    _reference.check_block_size(block_size, bits)
    _reference.check_rounding(rounding)
    _reference.check_scale_dtype(scale_dtype)
    return _quantize(x, bits, block_size, rounding, scale_dtype, interpret)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize(x, bits, block_size, rounding, scale_dtype, interpret):
    # Under jit, tracing both backends happens once per shape, not per call.
    static = dict(bits=bits, block_size=block_size, rounding=rounding, scale_dtype=scale_dtype)
    return by_platform(
        functools.partial(_triton.quantize, **static),
        functools.partial(_reference.quantize, **static),
        interpret,
        x,
    )
