"""Dequantization: `dequantize` (API) over `_triton` (kernel) and `_reference`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _reference, _triton
from pallas_kernels._dispatch import by_platform
from zpp_jax import quant
from zpp_jax.quant import QuantizedBlocks


def dequantize(
    q: QuantizedBlocks, bits: int, size: int, dtype=jnp.float32, *, interpret: bool = False
) -> jax.Array:
    """``(..., size)`` in `dtype` from blocks, exactly as `zpp_jax.quant.dequantize`.

    Reads 1 or 1/2 byte per element plus the scales; writes `dtype`.
    """
    quant.check_bits(bits)
    quant.check_float(dtype, "dequantize")
    return by_platform(
        functools.partial(_triton.dequantize, bits=bits, size=size, dtype=dtype),
        functools.partial(_reference.dequantize, bits=bits, size=size, dtype=dtype),
        interpret,
        q,
    )
