"""How a sharded layer's weights travel: the wire format of its gathers.

`WeightWire.encode` turns this device's primary shard into the one vector
of bytes it sends: with qwZ its int8/int4 codes then its fp32 scales
(`quant.pack`; each of the layout's segments quantized in blocks of its
own, the short ones together), else the raw bits of `comm_dtype`.
`WeightWire.decode` turns every device's bytes, stacked as rows, back into
the full parameters in the compute dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as kernels
from zpp_jax import collectives, quant
from zpp_jax.config import ZeroPPConfig
from zpp_jax.partition import Layout

PyTree = Any


class WeightWire:
    """The wire format of one layer's weights (`layout`, `config`), decoded
    to `compute_dtype` (None: each leaf's own dtype)."""

    def __init__(self, layout: Layout, config: ZeroPPConfig, compute_dtype=None) -> None:
        self.layout, self.config, self.compute_dtype = layout, config, compute_dtype

    def encode(self, shard: jax.Array) -> jax.Array:
        """This device's shard as it travels: one vector of bytes holding its
        int8/int4 codes then its fp32 scales (`quant.pack` of `_quantized`),
        or the raw bits of `comm_dtype`."""
        if not self.config.quantize_weights:
            return collectives.to_bits(shard.astype(self._wire_dtype))
        return quant.pack(self._quantized(shard))

    def _scales_of(self, rows):
        """The fp32 scales of gathered wire rows (..., bytes): their tail, as
        `quant.pack` wrote it (the codes are read where they lie)."""
        count = self._wire_parts.scales.size
        tail = rows[..., rows.shape[-1] - 4 * count :].reshape(*rows.shape[:-1], count, 4)
        return lax.bitcast_convert_type(tail, jnp.float32)

    @functools.cached_property
    def _wire_parts(self) -> quant.QuantizedBlocks:
        """Shapes and dtypes of one device's quantized shard (traced once)."""
        return jax.eval_shape(
            self._quantized, jax.ShapeDtypeStruct((self.layout.shard_size,), jnp.float32)
        )

    def _quantized(self, shard):
        """This device's shard quantized: int8/int4 codes and fp32 scales
        (`quant.QuantizedBlocks`, each of the layout's segments quantized in
        blocks of its own, codes and scales concatenated)."""
        cfg = self.config
        big, small, width = self._segment_groups()
        codes, scales = [], []
        for o, k in big:
            q = kernels.quantize(shard[o : o + k], cfg.weight_bits, cfg.block_size)
            codes.append(q.codes.reshape(-1))
            scales.append(q.scales)
        if small:
            # The segments shorter than a block (biases, norm scales) are one
            # block each: quantized together as the rows of one zero-padded
            # matrix, one kernel instead of one per tensor. Their padding
            # does not travel.
            rows = jnp.stack([jnp.pad(shard[o : o + k], (0, width - k)) for o, k in small])
            q = kernels.quantize(rows, cfg.weight_bits, width)
            codes += [q.codes[i, 0, : self._code_bytes(k)] for i, (_, k) in enumerate(small)]
            scales.append(q.scales.reshape(-1))
        return quant.QuantizedBlocks(jnp.concatenate(codes), jnp.concatenate(scales))

    def _segment_groups(self):
        """The layout's segments split into those quantized one by one (a run
        of whole blocks or a tensor longer than a block) and those shorter
        than a block, quantized together as rows padded to `width`."""
        cfg, segments = self.config, self.layout.segments
        big = [(o, k) for o, k in segments if k >= cfg.block_size]
        small = [(o, k) for o, k in segments if k < cfg.block_size]
        width = max((k for _, k in small), default=0)
        return big, small, quant.effective_block_size(width, cfg.block_size, cfg.weight_bits)

    def _code_bytes(self, k: int) -> int:
        """Bytes of codes of a segment of `k` elements, shorter than a block:
        one block of its own length (even for int4, two codes per byte)."""
        return self._blocks_of(k)[2]

    @property
    def _decoded_dtype(self):
        """What the dequantization writes: `compute_dtype` (fp32 products
        rounded once, as a cast after them would; a bf16 weight is written
        in 2 bytes, not 4 and then copied), else fp32 (each leaf is then
        cast to its own dtype)."""
        return jnp.float32 if self.compute_dtype is None else jnp.dtype(self.compute_dtype)

    @property
    def _wire_dtype(self):
        return jnp.float32 if self.config.comm_dtype is None else jnp.dtype(self.config.comm_dtype)

    def decode(self, rows: jax.Array, swapped: bool = False) -> PyTree:
        """Every device's wire, stacked as rows (N, ...) -> the full
        parameters in `compute_dtype` (default: each leaf's own). With
        `swapped`, the rows come as (local, nodes, ...), as a gather over
        `local` of a gather over `node` stacks them: the dequantization
        reads them in node-major order where they lie, and only what is
        small (the scales, short tensors) is reordered by a copy."""
        cfg, layout = self.config, self.layout
        if not cfg.quantize_weights:
            values = collectives.from_bits(_node_major(rows, swapped), self._wire_dtype)
            return layout.unflatten_rows(values.astype(jnp.float32), self.compute_dtype)
        by_offset, c0, s0 = {}, 0, 0
        scales = self._scales_of(rows)
        big, small, width = self._segment_groups()
        for o, k in big:
            by_offset.update(self._decode_segment(rows, scales, swapped, o, k, c0, s0))
            _, nb, nbytes = self._blocks_of(k)
            c0, s0 = c0 + nb * nbytes, s0 + nb
        if small:
            by_offset.update(self._decode_short(rows, scales, swapped, small, width, c0, s0))
        return layout.from_segments(by_offset, self.compute_dtype)

    def _blocks_of(self, k: int) -> tuple[int, int, int]:
        """(Elements per block, blocks, bytes of codes per block) of a segment
        of `k` elements quantized on its own."""
        bits = self.config.weight_bits
        block = quant.effective_block_size(k, self.config.block_size, bits)
        return block, quant.num_blocks(k, block), block * bits // 8

    def _codes(self, rows, swapped: bool, start: int, end: int) -> jax.Array:
        """Node-major rows (N, end - start) of the codes at bytes [start, end)."""
        piece = rows[..., start:end]
        if self._wire_parts.codes.dtype != jnp.uint8:
            piece = lax.bitcast_convert_type(piece, self._wire_parts.codes.dtype)
        return _node_major(piece, swapped)

    def _decode_segment(self, rows, scales, swapped: bool, o, k, c0, s0) -> dict:
        """{offset: (N, length)} of segment (`o`, `k`), whose codes start at
        byte `c0` and scales (`_scales_of` the rows) at `s0`. The run of
        whole-block tensors at the start of the wire is read in place, each
        tensor written alone (`pallas_kernels.dequantize_runs`); another
        segment is one tensor."""
        cfg = self.config
        block, nb, nbytes = self._blocks_of(k)
        runs = self._tensors_in(o, k, block) if c0 == 0 else None
        scales = scales[..., s0 : s0 + nb]
        if runs is None:
            codes = self._codes(rows, swapped, c0, c0 + nb * nbytes).reshape(-1, nb, nbytes)
            q = quant.QuantizedBlocks(codes, _node_major(scales, swapped))
            return {o: kernels.dequantize(q, cfg.weight_bits, k, self._decoded_dtype)}
        decoded = kernels.dequantize_runs(
            quant.QuantizedBlocks(rows, scales),
            cfg.weight_bits,
            runs,
            self._decoded_dtype,
            block=block,
            swap_lead=swapped,
        )
        firsts = np.cumsum((0, *runs[:-1]))
        n = self.layout.num_shards
        return {o + int(f) * block: v.reshape(n, -1) for f, v in zip(firsts, decoded, strict=True)}

    def _decode_short(self, rows, scales, swapped: bool, small, width, c0, s0) -> dict:
        """{offset: (N, length)} of the segments shorter than a block, their
        codes from byte `c0` and scales (`_scales_of` the rows) from `s0`:
        one kernel, as rows of a zero-padded matrix."""
        padded = []
        for _, k in small:
            nbytes = self._code_bytes(k)
            piece = self._codes(rows, swapped, c0, c0 + nbytes)
            padded.append(jnp.pad(piece, ((0, 0), (0, self._code_bytes(width) - nbytes))))
            c0 += nbytes
        scales = _node_major(scales[..., s0 : s0 + len(small)], swapped)
        q = quant.QuantizedBlocks(jnp.stack(padded, axis=1)[:, :, None], scales[..., None])
        values = kernels.dequantize(q, self.config.weight_bits, width, self._decoded_dtype)
        return {o: values[:, i, :k] for i, (o, k) in enumerate(small)}

    def _tensors_in(self, offset: int, length: int, block: int) -> tuple[int, ...] | None:
        """Blocks of each tensor that segment (`offset`, `length`) holds back to
        back in whole blocks (a `ParamLayout`'s leading run), to be decoded
        each on its own; None for a segment of one tensor, or of a layout
        that does not place its tensors (`FlatLayout`)."""
        pieces = sorted(getattr(self.layout, "slices", ()))
        inside = [(o, k) for o, k in pieces if offset <= o < offset + length]
        ends = [o + k for o, k in inside]
        if (
            len(inside) < 2
            or [o for o, _ in inside] != [offset, *ends[:-1]]
            or ends[-1] != offset + length
            or any(k % block for _, k in inside)
        ):
            return None
        return tuple(k // block for _, k in inside)


def _node_major(x: jax.Array, swapped: bool) -> jax.Array:
    """Rows (N, ...) as they are, or (local, nodes, ...) in node-major order
    (N, ...): a copy, made as a concatenation of contiguous slices (left as
    a transpose, XLA:CPU fuses it into what reads it, which then runs
    several times slower)."""
    return jnp.concatenate([x[:, n] for n in range(x.shape[1])]) if swapped else x
