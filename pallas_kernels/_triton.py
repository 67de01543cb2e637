"""Pallas kernels (Triton lowering) for block quantization.

Layout: every kernel works on rows of one quantization block each, a tile of
R rows per program. Blocks whose width is not a power of two are padded with
zeros to one (Triton tiles are powers of two): a copy made only when needed
(never for the engine's default 256 / 64 blocks). A row count that R does not
divide is not padded: Triton masks the loads and stores of the last tile's
rows past the array (each row is a block of its own, so the rows it reads
there reach no stored value). int4 blocks are handled as their two
contiguous halves, matching the packing of `_reference`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _reference as ref
from pallas_kernels._reference import QuantizedBlocks

_TILE_ELEMENTS = 8192
_NUM_WARPS = 4


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _floor_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _rows_per_tile(rows: int, width: int) -> int:
    return min(_pow2(rows), _floor_pow2(max(1, _TILE_ELEMENTS // width)))


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=_NUM_WARPS),
    )


# -- numerics shared by every kernel (identical to _reference) -----------------


def _round_half_even(y):
    # jnp.round has no Triton lowering. On |y|, floor and the remainder are
    # exact, so this equals round-half-to-even for every finite y.
    a = jnp.abs(y)
    r = jnp.floor(a)
    d = a - r
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    up = jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)
    return jnp.where(y < 0, -(r + up), r + up)


def _positions(parts, block):
    """Each element's position in its block (uint32, like the part): part 0
    holds elements 0.., the second part of an int4 block elements block/2.."""
    w = parts[0].shape[1]
    column = jnp.arange(w, dtype=jnp.int32)[None, :]
    return [
        jnp.broadcast_to(column + i * (block // 2), p.shape).astype(jnp.uint32)
        for i, p in enumerate(parts)
    ]


def _quantize_parts(parts, bits, rounding="nearest", block=0, scale_dtype="float32"):
    """fp32 parts of a tile of blocks (each (R, w)) -> float codes per part,
    scales (R,). `block` (the block's element count) places the elements of
    each part for stochastic rounding."""
    qmax = float(ref.qmax(bits))
    absmax = None
    for p in parts:
        # NaN counts as +Inf: max reductions need not propagate NaN, +Inf they keep.
        a = jnp.abs(p)
        m = jnp.max(jnp.where(a < jnp.inf, a, jnp.inf), axis=1)
        absmax = m if absmax is None else jnp.maximum(absmax, m)
    scales = ref.scale_of(absmax, bits, scale_dtype)
    finite = scales < jnp.inf
    safe = jnp.where((scales == 0) | ~finite, 1.0, scales)
    if rounding == "stochastic":
        rounded = [
            jnp.floor(
                p / safe[:, None] + ref.dither(jax.lax.bitcast_convert_type(p, jnp.uint32), j)
            )
            for p, j in zip(parts, _positions(parts, block), strict=True)
        ]
    else:
        rounded = [_round_half_even(p / safe[:, None]) for p in parts]
    codes = [jnp.where(finite[:, None], jnp.clip(r, -qmax, qmax), 0.0) for r in rounded]
    return codes, scales


def _pack(lo, hi):
    v = (lo.astype(jnp.int32) & 15) | ((hi.astype(jnp.int32) & 15) << 4)
    return v.astype(jnp.uint8)


def _unpack(packed):
    v = packed.astype(jnp.int32)
    lo, hi = v & 15, (v >> 4) & 15
    return jnp.where(lo >= 8, lo - 16, lo), jnp.where(hi >= 8, hi - 16, hi)


def _decode(codes, bits):
    """Codes of a tile -> fp32 parts (one for int8, two halves for int4)."""
    if bits == 8:
        return [codes.astype(jnp.float32)]
    return [c.astype(jnp.float32) for c in _unpack(codes)]


def _store_codes(ref, codes, bits):
    if bits == 8:
        ref[...] = codes[0].astype(jnp.int8)
    else:
        ref[...] = _pack(codes[0], codes[1])


def _store_parts(ref, parts, dtype):
    if len(parts) == 1:
        ref[...] = parts[0].astype(dtype)
    else:
        ref[:, 0, :] = parts[0].astype(dtype)
        ref[:, 1, :] = parts[1].astype(dtype)


def _load_parts(ref, halves):
    if not halves:
        return [ref[...].astype(jnp.float32)]
    return [ref[:, 0, :].astype(jnp.float32), ref[:, 1, :].astype(jnp.float32)]


# -- blocked layouts -----------------------------------------------------------


def _blocked(x: jax.Array, block: int, bits: int) -> tuple[jax.Array, int, int]:
    """(..., n) -> (..., nb, W) or (..., nb, 2, W) with W a power of two."""
    n = x.shape[-1]
    nb = ref.num_blocks(n, block)
    x = _pad_axis(x, -1, nb * block).reshape(*x.shape[:-1], nb, block)
    if bits == 4:
        x = x.reshape(*x.shape[:-1], 2, block // 2)
        return _pad_axis(x, -1, _pow2(block // 2)), nb, _pow2(block // 2)
    return _pad_axis(x, -1, _pow2(block)), nb, _pow2(block)


# -- quantize (optionally with the leading axes swapped) ------------------------


def _quantize_kernel(bits, rounding, block, scale_dtype, x_ref, *refs):
    with_residual = len(refs) == 4  # an error-feedback residual in, the new one out
    r_ref, c_ref, s_ref, o_ref = refs if with_residual else (None, *refs, None)
    parts = _load_parts(x_ref, bits == 4)
    if with_residual:
        parts = [a + b for a, b in zip(parts, _load_parts(r_ref, bits == 4), strict=True)]
    codes, scales = _quantize_parts(parts, bits, rounding, block, scale_dtype)
    _store_codes(c_ref, codes, bits)
    s_ref[...] = scales
    if with_residual:
        lost = [t - c * scales[:, None] for t, c in zip(parts, codes, strict=True)]
        _store_parts(o_ref, lost, jnp.float32)


def quantize_4d(
    x: jax.Array,
    bits: int,
    block: int,
    swap: bool,
    interpret: bool,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
    residual: jax.Array | None = None,
):
    """x (A, B, n) -> QuantizedBlocks of (B, A, nb, ...) if `swap` else (A, B, nb, ...).

    With `residual` (the output's leading shape, then n) it is added to x
    before quantizing, and (blocks, what the quantization lost) is returned."""
    a, b, n = x.shape
    xb, nb, w = _blocked(x, block, bits)
    r = _rows_per_tile(nb, w * (2 if bits == 4 else 1))
    out_lead = (b, a) if swap else (a, b)
    cdtype = jnp.uint8 if bits == 4 else jnp.int8

    def src(i, j, t):
        return (j, i, t) if swap else (i, j, t)  # grid (i, j) walks the output order

    if bits == 4:
        in_spec = pl.BlockSpec((None, None, r, 2, w), lambda i, j, t: (*src(i, j, t), 0, 0))
    else:
        in_spec = pl.BlockSpec((None, None, r, w), lambda i, j, t: (*src(i, j, t), 0))
    grid = (out_lead[0], out_lead[1], -(-nb // r))
    args, in_specs = [xb], [in_spec]
    out_specs = [
        pl.BlockSpec((None, None, r, w), lambda i, j, t: (i, j, t, 0)),
        pl.BlockSpec((None, None, r), lambda i, j, t: (i, j, t)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((*out_lead, nb, w), cdtype),
        jax.ShapeDtypeStruct((*out_lead, nb), jnp.float32),
    ]
    if residual is not None:
        rb, _, _ = _blocked(residual.astype(jnp.float32), block, bits)
        args.append(rb)
        parts = (2, w) if bits == 4 else (w,)
        spec = pl.BlockSpec((None, None, r, *parts), lambda i, j, t: (i, j, t) + (0,) * len(parts))
        in_specs.append(spec)
        out_specs.append(spec)
        out_shape.append(jax.ShapeDtypeStruct((*out_lead, nb, *parts), jnp.float32))
    outs = _call(
        functools.partial(_quantize_kernel, bits, rounding, block, scale_dtype),
        grid,
        in_specs,
        out_specs,
        out_shape,
        interpret,
    )(*args)
    cw = block // 2 if bits == 4 else block
    q = QuantizedBlocks(outs[0][:, :, :nb, :cw], outs[1][:, :, :nb])
    if residual is None:
        return q
    lost = outs[2].reshape(out_lead[0] * out_lead[1], *outs[2].shape[2:])
    return q, _unblock(lost, bits, out_lead, nb, cw, n)


def quantize(
    x: jax.Array,
    bits: int,
    block_size: int,
    interpret: bool,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
) -> QuantizedBlocks:
    lead = x.shape[:-1]
    block = ref.effective_block_size(x.shape[-1], block_size, bits)
    x3 = x.reshape(1, math.prod(lead), x.shape[-1])
    q = quantize_4d(x3, bits, block, False, interpret, rounding, scale_dtype)
    return QuantizedBlocks(
        q.codes.reshape(*lead, *q.codes.shape[2:]), q.scales.reshape(*lead, q.scales.shape[-1])
    )


def quantize_reordered(
    full,
    nodes,
    local,
    bits,
    block_size,
    interpret,
    rounding="nearest",
    scale_dtype="float32",
    residual=None,
):
    s = full.shape[-1] // (nodes * local)
    block = ref.effective_block_size(s, block_size, bits)
    x = full.reshape(nodes, local, s)
    return quantize_4d(x, bits, block, True, interpret, rounding, scale_dtype, residual)


# -- dequantize ----------------------------------------------------------------


def _codes_blocked(q: QuantizedBlocks, bits: int):
    """Codes (..., nb, c) -> (G, nb, W) padded to a power of two, scales
    (G, nb); returns the tile rows too (the last tile may hold fewer rows:
    Triton masks what lies past the array)."""
    lead = q.codes.shape[:-2]
    nb, c = q.codes.shape[-2:]
    g = math.prod(lead)
    w = _pow2(c)
    r = _rows_per_tile(nb, w * (2 if bits == 4 else 1))
    codes = _pad_axis(q.codes.reshape(g, nb, c), 2, w)
    return codes, q.scales.reshape(g, nb), lead, nb, c, w, r


def _dequantize_kernel(bits, dtype, c_ref, s_ref, o_ref):
    scale = s_ref[...][:, None]
    _store_parts(o_ref, [p * scale for p in _decode(c_ref[...], bits)], dtype)


def _parts_spec(r, w, bits, lead_dims=1):
    none = (None,) * lead_dims
    if bits == 4:
        return pl.BlockSpec((*none, r, 2, w), lambda i, t: (i, t, 0, 0))
    return pl.BlockSpec((*none, r, w), lambda i, t: (i, t, 0))


def _unblock(parts, bits, lead, nb, c, size):
    """(G, nb, [2,] W) -> (..., size)."""
    g = parts.shape[0]
    if bits == 4:
        parts = parts[:, :nb, :, :c].reshape(g, nb * 2 * c)
    else:
        parts = parts[:, :nb, :c].reshape(g, nb * c)
    return parts[:, :size].reshape(*lead, size)


def _parts_shape(g, nb, w, bits, dtype):
    shape = (g, nb, 2, w) if bits == 4 else (g, nb, w)
    return jax.ShapeDtypeStruct(shape, dtype)


def dequantize(q: QuantizedBlocks, bits: int, size: int, dtype, interpret: bool):
    codes, scales, lead, nb, c, w, r = _codes_blocked(q, bits)
    g = codes.shape[0]
    out = _call(
        functools.partial(_dequantize_kernel, bits, jnp.dtype(dtype)),
        (g, -(-nb // r)),
        [
            pl.BlockSpec((None, r, w), lambda i, t: (i, t, 0)),
            pl.BlockSpec((None, r), lambda i, t: (i, t)),
        ],
        _parts_spec(r, w, bits),
        _parts_shape(g, nb, w, bits, dtype),
        interpret,
    )(codes, scales)
    return _unblock(out, bits, lead, nb, c, size)


def _pow2_dividing(n: int, at_most: int) -> int:
    """The largest power of two dividing `n` (any, for 0), at most `at_most`."""
    return at_most if n == 0 else min(n & -n, at_most)


def _dequantize_runs_kernel(bits, dtype, tiles, width, c_ref, s_ref, *o_refs):
    # Tile `step` of the blocks belongs to one run: only that run's output
    # is written (Triton's refs point into memory; no other store happens).
    step = pl.program_id(1)
    codes = c_ref[...]
    if codes.ndim == 1:  # a row of bytes: its blocks, `width` bytes each
        codes = codes.reshape(-1, width)
    if bits == 8 and codes.dtype == jnp.uint8:  # int8 codes read as bytes
        codes = (codes.astype(jnp.int32) ^ 128) - 128
    scale = s_ref[...][:, None]
    parts = [p * scale for p in _decode(codes, bits)]
    for (first, end), o_ref in zip(tiles, o_refs, strict=True):

        @pl.when((step >= first) & (step < end))
        def _store(o_ref=o_ref):
            _store_parts(o_ref, parts, dtype)


def _run_spec(r, w, bits, first, count):
    """Output spec of a run of `count` tiles starting at tile `first`: grid
    step (i, t) is the run's tile t - first (clamped outside the run, where
    the kernel stores nothing)."""

    def tile(i, t):
        return (i, jnp.clip(t - first, 0, count - 1))

    if bits == 4:
        return pl.BlockSpec((None, r, 2, w), lambda i, t: (*tile(i, t), 0, 0))
    return pl.BlockSpec((None, r, w), lambda i, t: (*tile(i, t), 0))


def _runs_in_specs(q, r, c, flat, swap_lead):
    """Specs of the codes and scales, read in place: row i of the result is
    q's row i, or with `swap_lead` (q's leading axes (a, b)) its row
    (i % a, i // a); a tile is r blocks, as r x c bytes of a row of bytes."""
    lead = q.scales.shape[:-1]
    if swap_lead:
        a = lead[0]

        def row(i):
            return (i % a, i // a)

        none = (None, None)
    else:

        def row(i):
            return (i,)

        none = (None,)
    if flat:
        codes = pl.BlockSpec((*none, r * c), lambda i, t: (*row(i), t))
    else:
        codes = pl.BlockSpec((*none, r, c), lambda i, t: (*row(i), t, 0))
    return [codes, pl.BlockSpec((*none, r), lambda i, t: (*row(i), t))]


def dequantize_runs(
    q: QuantizedBlocks, bits: int, runs, dtype, interpret: bool, block=None, swap_lead=False
):
    """One kernel over every block, in tiles that never straddle two runs,
    writing each tile to its run's own output: the codes are read once, in
    place (from a row of bytes, in either order of two leading axes), and
    each run written once, where one output would be sliced into the runs
    afterwards (a copy of every element). Blocks padded to a power of two
    are rearranged, dequantized whole and split."""
    lead, nb = q.scales.shape[:-1], q.scales.shape[-1]
    flat = block is not None
    c = block * bits // 8 if flat else q.codes.shape[-1]
    per_block, g = c * (2 if bits == 4 else 1), math.prod(lead)
    out_lead = (lead[1], lead[0], *lead[2:]) if swap_lead else lead
    if _pow2(c) != c:
        q = ref.blocks_in_order(q, bits, block, swap_lead)
        whole = dequantize(q, bits, nb * per_block, dtype, interpret)
        return ref.split_runs(whole, runs, per_block)
    r = _rows_per_tile(nb, per_block)
    for n in runs:  # tiles that divide every run
        r = _pow2_dividing(n, r)
    starts = [sum(runs[:i]) // r for i in range(len(runs))]
    tiles = tuple((a, a + n // r) for a, n in zip(starts, runs, strict=True))
    if not swap_lead:  # one leading axis of rows
        q = QuantizedBlocks(
            q.codes.reshape(g, *q.codes.shape[len(lead) :]), q.scales.reshape(g, nb)
        )
    outs = _call(
        functools.partial(_dequantize_runs_kernel, bits, jnp.dtype(dtype), tiles, c),
        (g, nb // r),
        _runs_in_specs(q, r, c, flat, swap_lead),
        [_run_spec(r, c, bits, a, b - a) for a, b in tiles],
        [_parts_shape(g, n, c, bits, dtype) for n in runs],
        interpret,
    )(q.codes, q.scales)
    return tuple(o.reshape(*out_lead, n * per_block) for o, n in zip(outs, runs, strict=True))


# -- fused dequantize -> sum over k -> (+ residual) -> requantize ----------------


def _dsq_kernel(bits, k, with_residual, rounding, block, scale_dtype, c_ref, s_ref, *refs):
    if with_residual:
        r_ref, oc_ref, os_ref, or_ref = refs
    else:
        oc_ref, os_ref = refs
    total = None
    for j in range(k):
        scale = s_ref[j][:, None]
        parts = [p * scale for p in _decode(c_ref[j], bits)]
        total = parts if total is None else [a + b for a, b in zip(total, parts, strict=True)]
    if with_residual:
        total = [a + b for a, b in zip(total, _load_parts(r_ref, bits == 4), strict=True)]
    codes, scales = _quantize_parts(total, bits, rounding, block, scale_dtype)
    _store_codes(oc_ref, codes, bits)
    os_ref[...] = scales
    if with_residual:
        lost = [t - c * scales[:, None] for t, c in zip(total, codes, strict=True)]
        _store_parts(or_ref, lost, jnp.float32)


def dequantize_sum_quantize(
    q, bits, size, residual, interpret, rounding="nearest", scale_dtype="float32"
):
    k = q.codes.shape[0]
    sub = QuantizedBlocks(q.codes[0], q.scales[0])
    _, _, lead, nb, c, w, r = _codes_blocked(sub, bits)
    g = math.prod(lead)
    codes = _pad_axis(q.codes.reshape(k, g, nb, c), 3, w)
    scales = q.scales.reshape(k, g, nb)
    args = [codes, scales]
    in_specs = [
        pl.BlockSpec((k, None, r, w), lambda i, t: (0, i, t, 0)),
        pl.BlockSpec((k, None, r), lambda i, t: (0, i, t)),
    ]
    cdtype = jnp.uint8 if bits == 4 else jnp.int8
    out_specs = [
        pl.BlockSpec((None, r, w), lambda i, t: (i, t, 0)),
        pl.BlockSpec((None, r), lambda i, t: (i, t)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((g, nb, w), cdtype),
        jax.ShapeDtypeStruct((g, nb), jnp.float32),
    ]
    with_residual = residual is not None
    block = c * (2 if bits == 4 else 1)
    if with_residual:
        rb, _, _ = _blocked(residual.astype(jnp.float32).reshape(g, size), block, bits)
        args.append(rb)
        in_specs.append(_parts_spec(r, w, bits))
        out_specs.append(_parts_spec(r, w, bits))
        out_shape.append(_parts_shape(g, nb, w, bits, jnp.float32))
    outs = _call(
        functools.partial(_dsq_kernel, bits, k, with_residual, rounding, block, scale_dtype),
        (g, -(-nb // r)),
        in_specs,
        out_specs,
        out_shape,
        interpret,
    )(*args)
    out = QuantizedBlocks(
        outs[0][:, :nb, :c].reshape(*lead, nb, c), outs[1][:, :nb].reshape(*lead, nb)
    )
    new = _unblock(outs[2], bits, lead, nb, c, size) if with_residual else None
    return out, new
