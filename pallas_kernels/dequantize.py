"""Dequantization: `dequantize` and `dequantize_runs` (API) over `_triton`
(kernels) and `_reference`."""

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


def dequantize_runs(
    q: QuantizedBlocks,
    bits: int,
    runs: tuple[int, ...],
    dtype=jnp.float32,
    *,
    block: int | None = None,
    swap_lead: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Blocks that hold consecutive runs (tensors), `runs[i]` blocks each,
    dequantized as one array per run, ``(..., runs[i] x the block's
    elements)``: the slices of `dequantize`'s result, bit for bit.

    `q.codes` is (..., blocks, bytes per block), or, given `block` (elements
    per block), a row of bytes (..., L) whose first blocks x bytes per
    block hold them (int8 codes as uint8 bytes: a gathered wire, whose
    scales follow); the scales are (..., blocks) and say how many blocks
    there are. With `swap_lead`, `q`'s two leading axes (a, b) are the
    result's (b, a): rows gathered in the other order.

    Reads 1 or 1/2 byte per element plus the scales and writes `dtype` once:
    the codes are read where they lie, in either order of rows, and each
    run written where it is used, not as part of one array that a slice
    then copies out (a second pass over every element).
    """
    _reference.check_bits(bits)
    _reference.check_float(dtype, "dequantize")
    runs = tuple(int(n) for n in runs)
    blocks = q.scales.shape[-1]
    if sum(runs) != blocks or min(runs, default=0) < 1:
        raise ValueError(
            f"runs {runs} must be positive block counts summing to the {blocks} blocks of q"
        )
    if swap_lead and q.scales.ndim != 3:
        raise ValueError(f"swap_lead needs two leading axes, got scales of shape {q.scales.shape}")
    if block is not None:
        _reference.check_block_size(block, bits)
    return _dequantize_runs(q, bits, runs, jnp.dtype(dtype), interpret, block, swap_lead)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _dequantize_runs(q, bits, runs, dtype, interpret, block, swap_lead):
    options = dict(bits=bits, runs=runs, dtype=dtype, block=block, swap_lead=swap_lead)
    return by_platform(
        functools.partial(_triton.dequantize_runs, **options),
        functools.partial(_reference.dequantize_runs, **options),
        interpret,
        q,
    )
