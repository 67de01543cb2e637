"""The numerics of block quantization, and the plain-JAX reference of every op.

This module defines the numbers; every kernel backend (`_triton.py`) must
match it bit for bit:

* The input is cast to fp32 and cut along its last axis into blocks of `block`
  elements; the last block is padded with zeros (padding never changes a
  block's absmax, and it is dropped again by `dequantize`).
* Per block: ``absmax = max(|x|)``, ``scale = round_up_scale(absmax * (1/qmax))``
  in fp32 with ``qmax = 2**(bits-1) - 1`` (127 for int8, 7 for int4:
  symmetric, no zero point, the code -2**(bits-1) is never produced) and
  ``1/qmax`` the fp32 reciprocal (`scale_of`). A multiply, not a division:
  XLA rewrites a division by a constant into this multiply when it compiles
  a program, and a division dispatched on its own is left IEEE, so only the
  multiply gives the same bits compiled, eager and in every kernel.
  ``round_up_scale`` rounds the fp32 scale up to 16 significant bits (clears the
  low 8 mantissa bits, rounding away from zero); with
  ``scale_dtype="bfloat16"`` to 8 (the low 16 bits: the scale is then exact
  in bf16 and may travel in 2 bytes). Then every ``code * scale``
  is exact in fp32, so dequantization, sums of dequantized values and the
  error-feedback residual round identically whether or not a compiler fuses
  the multiply into an add (FMA): kernels match the reference bit for bit on
  any backend.
* ``code = clip(round_half_to_even(x / scale), -qmax, qmax)`` with an IEEE fp32
  division (``rounding="nearest"``), or, with ``rounding="stochastic"``,
  ``code = clip(floor(x / scale + u), -qmax, qmax)`` where ``u`` in [0, 1) is
  `dither`: a hash of the element's fp32 bits and its position in its block.
  Stochastic rounding is unbiased (the expected code is ``x / scale``), so
  the errors of many small gradients do not all round to zero in the same
  direction; being a pure function of the input it stays bit-reproducible
  and needs no random key. (Elements equal in value and in position within
  their blocks round alike.) An all-zero block has ``scale = 0`` and codes 0, and dequantizes to
  exact zeros (never NaN).
* A block holding NaN or +-Inf gets scale +Inf and codes 0, so every
  element of it dequantizes to NaN: a non-finite gradient can never turn into a
  silently wrong finite value.
* int4 codes are packed two per byte (uint8) within each block of b elements:
  byte j holds element j in its low nibble and element j + b/2 in its high
  nibble, two's complement. (Two contiguous halves, so a kernel reads and
  writes each half with unit stride.) Blocks are even-sized for int4, so a
  byte never straddles two blocks.
* ``dequantize = code * scale`` in fp32, then cast to the requested dtype.
* An axis shorter than one block is quantized as a single block of its own
  length (rounded up to even for int4): see `effective_block_size`.

The error of a finite element is at most half a step, ``scale / 2``, with
nearest rounding, and under one step, ``scale``, with stochastic rounding
(plus fp32 round-off of the division).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SUPPORTED_BITS = (4, 8)
ROUNDINGS = ("nearest", "stochastic")
# The dtype scales are exact in, so that they may travel in it: fp32 scales
# are rounded up to 16 significant bits, bf16 ones to 8 (2 bytes a block).
SCALE_DTYPES = ("float32", "bfloat16")
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class QuantizedBlocks(NamedTuple):
    """Codes and scales of a block-quantized array.

    codes: int8 ``(..., nblocks, block)`` for 8 bits, uint8
      ``(..., nblocks, block // 2)`` for 4 bits (two codes per byte).
    scales: fp32 ``(..., nblocks)``.
    """

    codes: jax.Array
    scales: jax.Array


# -- validation ------------------------------------------------------------------


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")


def check_block_size(block_size: int, bits: int) -> None:
    if (
        not isinstance(block_size, (int, np.integer))
        or isinstance(block_size, bool)
        or block_size <= 0
    ):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if bits == 4 and block_size % 2:
        raise ValueError(
            f"block_size={block_size} is odd; 4-bit codes are packed two per byte "
            "within a block, so use an even block_size"
        )


def check_scale_dtype(scale_dtype: str) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r} is not supported; use one of {SCALE_DTYPES}")


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; use one of {ROUNDINGS}")


def check_float(dtype, what: str) -> None:
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(
            f"{what} supports float32, bfloat16 and float16, got {jnp.dtype(dtype).name}; "
            "cast the array to a floating dtype first"
        )


# -- block geometry --------------------------------------------------------------


def qmax(bits: int) -> int:
    """Largest code magnitude for a bit width (127 or 7)."""
    check_bits(bits)
    return 2 ** (bits - 1) - 1


def effective_block_size(n: int, block_size: int, bits: int) -> int:
    """The block size actually used for an axis of `n` elements.

    An axis shorter than one block is quantized as a single block of its own
    length (rounded up to even for int4): the same absmax, the same codes, fewer
    padding bytes.
    """
    check_bits(bits)
    check_block_size(block_size, bits)
    if n >= block_size:
        return int(block_size)
    return int(n + (n % 2)) if bits == 4 else max(int(n), 1)


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def block_of(q: QuantizedBlocks, bits: int) -> int:
    """The (effective) block size quantized blocks were made with."""
    return q.codes.shape[-1] * (2 if bits == 4 else 1)


# -- the numerics ----------------------------------------------------------------


def round_up_scale(scale: jax.Array, scale_dtype: str) -> jax.Array:
    """Round non-negative fp32 scales up to 16 significant bits ("float32")
    or 8 ("bfloat16": then exact in bf16). Inf and NaN stay as they are; IEEE
    ordering makes the carry into the exponent right."""
    low = 0xFF if scale_dtype == "float32" else 0xFFFF
    u = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    u = (u + jnp.uint32(low)) & jnp.uint32(0xFFFFFFFF ^ low)
    rounded = jax.lax.bitcast_convert_type(u, jnp.float32)
    # `< inf` rather than isfinite: the same test inside the Triton kernels.
    return jnp.where(scale < jnp.inf, rounded, scale)


def scale_of(absmax: jax.Array, bits: int, scale_dtype: str) -> jax.Array:
    """The scales of blocks of these fp32 absolute maxima: ``absmax`` times
    the fp32 reciprocal of `qmax`, rounded up (`round_up_scale`). Where the
    reciprocal is rounded down, the largest element over its scale exceeds
    ``qmax`` by at most 2**-24 of it, and still rounds to ``qmax``."""
    inverse = np.float32(1) / np.float32(qmax(bits))
    return round_up_scale(absmax * inverse, scale_dtype)


def dither(bits: jax.Array, position: jax.Array) -> jax.Array:
    """Uniform fp32 in [0, 1), multiples of 2**-24: the murmur3 finalizer of
    an element's fp32 bits (uint32) mixed with its position in its block
    (uint32). The same on every backend: integer ops only."""
    h = bits ^ (position * jnp.uint32(0x9E3779B9))
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def pack_int4(codes: jax.Array) -> jax.Array:
    """Pack int8 codes in [-8, 7] of blocks along the last (even) axis -> uint8:
    byte j = element j (low nibble) | element j + b/2 (high nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last axis, got shape {codes.shape}")
    half = codes.shape[-1] // 2
    u = codes.astype(jnp.uint8) & jnp.uint8(0x0F)
    return u[..., :half] | (u[..., half:] << jnp.uint8(4))


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_int4`: uint8 ``(..., m)`` -> int8 ``(..., 2m)``, sign-extended."""
    b = packed.astype(jnp.int8)
    # Shifting left then arithmetic-right sign-extends each nibble.
    lo = (b << 4) >> 4
    hi = b >> 4
    return jnp.concatenate([lo, hi], axis=-1)


def _magnitude(x: jax.Array) -> jax.Array:
    # |x|, with NaN counted as +Inf. A max reduction need not propagate NaN
    # (XLA:CPU's vectorized one does not), but it always keeps +Inf, so one
    # reduction finds both the absmax and any non-finite element (a separate
    # any(isnan) pass cost 4x the max on CPU).
    a = jnp.abs(x)
    return jnp.where(a < jnp.inf, a, jnp.float32(jnp.inf))


# -- reference ops ---------------------------------------------------------------


def quantize(
    x: jax.Array,
    bits: int,
    block_size: int,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
) -> QuantizedBlocks:
    """Block-quantize `x` along its last axis (see the module docstring).

    Accepts fp32, bf16 and fp16, any length. Output bytes per element: 1 (int8)
    or 1/2 (int4), plus 4 bytes of scale per block.
    """
    check_float(x.dtype, "quantize")
    check_rounding(rounding)
    check_scale_dtype(scale_dtype)
    n = x.shape[-1]
    block = effective_block_size(n, block_size, bits)
    nb = num_blocks(n, block)
    xf = x.astype(jnp.float32)
    pad = nb * block - n
    if pad:
        xf = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    xf = xf.reshape(*x.shape[:-1], nb, block)
    absmax = jnp.max(_magnitude(xf), axis=-1)
    scales = scale_of(absmax, bits, scale_dtype)
    finite = scales < jnp.inf
    safe = jnp.where((scales == 0) | ~finite, jnp.float32(1), scales)
    y = xf / safe[..., None]
    if rounding == "stochastic":
        position = jax.lax.broadcasted_iota(jnp.uint32, xf.shape, xf.ndim - 1)
        y = jnp.floor(y + dither(jax.lax.bitcast_convert_type(xf, jnp.uint32), position))
    else:
        y = jnp.round(y)
    q = jnp.clip(y, -qmax(bits), qmax(bits))
    codes = jnp.where(finite[..., None], q, 0).astype(jnp.int8)
    if bits == 4:
        codes = pack_int4(codes)
    return QuantizedBlocks(codes, scales)


def dequantize(
    q: QuantizedBlocks, bits: int, size: int, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Inverse of `quantize`: ``(..., size)`` in `dtype`, padding dropped."""
    check_bits(bits)
    codes = unpack_int4(q.codes) if bits == 4 else q.codes
    x = codes.astype(jnp.float32) * q.scales[..., None]
    x = x.reshape(*x.shape[:-2], -1)[..., :size]
    return x.astype(dtype)


def blocks_in_order(
    q: QuantizedBlocks, bits: int, block: int | None = None, swap_lead: bool = False
) -> QuantizedBlocks:
    """`dequantize_runs`'s input as plain blocks (..., blocks, bytes per
    block), as many as the scales count, leading axes in the result's
    order: with `block`, the codes are the bytes (..., L) whose first
    blocks x bytes per block hold the blocks (int8 codes as uint8 bytes);
    with `swap_lead`, q's leading axes (a, b) become (b, a). Copies what it
    rearranges."""
    codes, scales = q.codes, q.scales
    nb = scales.shape[-1]
    if block is not None:
        c = block * bits // 8
        codes = codes[..., : nb * c].reshape(*codes.shape[:-1], nb, c)
        if bits == 8 and codes.dtype == jnp.uint8:
            codes = lax.bitcast_convert_type(codes, jnp.int8)
    codes = codes[..., :nb, :]
    if swap_lead:  # a stack of contiguous slices: XLA:CPU fuses a transpose
        # into the dequantization, which then runs several times slower
        codes, scales = (jnp.stack([x[:, j] for j in range(x.shape[1])]) for x in (codes, scales))
    return QuantizedBlocks(codes, scales)


def dequantize_runs(
    q: QuantizedBlocks,
    bits: int,
    runs: tuple[int, ...],
    dtype: jnp.dtype = jnp.float32,
    block: int | None = None,
    swap_lead: bool = False,
) -> tuple[jax.Array, ...]:
    """`dequantize` of blocks holding consecutive runs of `runs[i]` blocks
    each (they sum to the blocks of `q`'s scales): one array per run,
    ``(..., runs[i] x elements per block)``; `block` and `swap_lead` as
    `blocks_in_order` reads them."""
    q = blocks_in_order(q, bits, block, swap_lead)
    size = block_of(q, bits)
    return split_runs(dequantize(q, bits, sum(runs) * size, dtype), runs, size)


def split_runs(whole: jax.Array, runs: tuple[int, ...], block: int) -> tuple[jax.Array, ...]:
    """`whole` (..., sum(runs) x block) cut along its last axis into runs of
    `runs[i]` blocks of `block` elements."""
    bounds = [block * sum(runs[:i]) for i in range(1, len(runs))]
    return tuple(jnp.split(whole, bounds, axis=-1))


def dequantize_sum_quantize(
    q: QuantizedBlocks,
    bits: int,
    size: int,
    residual: jax.Array | None,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
) -> tuple[QuantizedBlocks, jax.Array | None]:
    """Sum over the leading axis of the dequantized inputs, left to right in
    fp32, plus `residual`; requantize with the same blocks; the new residual is
    what the requantization lost."""
    total = None
    for j in range(q.codes.shape[0]):
        part = dequantize(QuantizedBlocks(q.codes[j], q.scales[j]), bits, size)
        total = part if total is None else total + part
    if residual is not None:
        total = total + residual.astype(jnp.float32)
    out = quantize(total, bits, block_of(q, bits), rounding, scale_dtype)
    new = None if residual is None else total - dequantize(out, bits, size)
    return out, new


def quantize_reordered(
    full: jax.Array,
    nodes: int,
    local: int,
    bits: int,
    block_size: int,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
) -> QuantizedBlocks:
    """quantize(full.reshape(nodes, local, s).swapaxes(0, 1)): blocks of shape
    (local, nodes, nb, ...), row [l, n] = chunk n*local + l of `full`."""
    s = full.shape[-1] // (nodes * local)
    # Each chunk is a row with its own blocks either way, so quantizing in
    # place and swapping the chunk axes of codes and scales gives the same
    # bits, and the swap moves 1/8 (int4) of the bytes of the fp32 input.
    q = quantize(full.reshape(nodes, local, s), bits, block_size, rounding, scale_dtype)
    return jax.tree.map(lambda a: a.swapaxes(0, 1), q)


def quantize_reordered_with_feedback(
    full: jax.Array,
    residual: jax.Array,
    nodes: int,
    local: int,
    bits: int,
    block_size: int,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
) -> tuple[QuantizedBlocks, jax.Array]:
    """`quantize_reordered` of `full` plus `residual` (fp32, in the blocks'
    order: (local, nodes, s)), and what the quantization lost (fp32, same
    shape): the residual to add next time (error feedback)."""
    total = jnp.swapaxes(full.reshape(nodes, local, -1), 0, 1).astype(jnp.float32) + residual
    q = quantize(total, bits, block_size, rounding, scale_dtype)
    return q, total - dequantize(q, bits, total.shape[-1])
