"""Quantization with the gradient slice reordering of qgZ fused in."""

from __future__ import annotations

import functools

import jax

from pallas_kernels import _reference, _triton
from pallas_kernels._dispatch import by_platform
from pallas_kernels._reference import QuantizedBlocks


def quantize_reordered(
    full: jax.Array,
    nodes: int,
    local: int,
    bits: int,
    block_size: int,
    *,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
    interpret: bool = False,
) -> QuantizedBlocks:
    """Quantize a full gradient (nodes*local*s,) straight into the order the
    intra-node all-to-all sends it: blocks ``(local, nodes, nb, c)``, row
    [l, n] = chunk n*local + l, each chunk quantized in its own blocks.

    Equals ``quantize(full.reshape(nodes, local, s).swapaxes(0, 1))``; the
    kernel reads each chunk where it lies, so the reordered copy is never made.
    """
    _reference.check_float(full.dtype, "quantize_reordered")
    _reference.check_block_size(block_size, bits)
    _reference.check_rounding(rounding)
    _reference.check_scale_dtype(scale_dtype)
    if full.ndim != 1 or full.shape[0] % (nodes * local):
        raise ValueError(
            f"quantize_reordered needs a 1-D vector whose length is a multiple of "
            f"{nodes * local}, got shape {full.shape}"
        )
    return _quantize_reordered(
        full, nodes, local, bits, block_size, rounding, scale_dtype, interpret
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7))
def _quantize_reordered(full, nodes, local, bits, block_size, rounding, scale_dtype, interpret):
    # Under jit, tracing both backends happens once per shape, not per call.
    static = dict(
        nodes=nodes,
        local=local,
        bits=bits,
        block_size=block_size,
        rounding=rounding,
        scale_dtype=scale_dtype,
    )
    return by_platform(
        functools.partial(_triton.quantize_reordered, **static),
        functools.partial(_reference.quantize_reordered, **static),
        interpret,
        full,
    )
