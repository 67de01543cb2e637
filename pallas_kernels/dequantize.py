"""Dequantization: `dequantize` (API) over `_triton` (kernel) and `_reference`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _reference, _triton
from pallas_kernels._dispatch import by_platform
from pallas_kernels._reference import QuantizedBlocks


def dequantize(
    q: QuantizedBlocks, bits: int, size: int, dtype=jnp.float32, *, interpret: bool = False
) -> jax.Array:
    """``(..., size)`` in `dtype` from blocks, exactly as the reference `dequantize`.

    Reads 1 or 1/2 byte per element plus the scales; writes `dtype`.
    """
    _reference.check_bits(bits)
    _reference.check_float(dtype, "dequantize")
    return _dequantize(q, bits, size, jnp.dtype(dtype), interpret)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _dequantize(q, bits, size, dtype, interpret):
    # Under jit, tracing both backends happens once per shape, not per call.
    return by_platform(
        functools.partial(_triton.dequantize, bits=bits, size=size, dtype=dtype),
        functools.partial(_reference.dequantize, bits=bits, size=size, dtype=dtype),
        interpret,
        q,
    )
