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
    _check("quantize_reordered", full, nodes, local, bits, block_size, rounding, scale_dtype)
    return _quantize_reordered(
        full, None, nodes, local, bits, block_size, rounding, scale_dtype, interpret
    )


def quantize_reordered_with_feedback(
    full: jax.Array,
    residual: jax.Array,
    nodes: int,
    local: int,
    bits: int,
    block_size: int,
    *,
    rounding: str = "nearest",
    scale_dtype: str = "float32",
    interpret: bool = False,
) -> tuple[QuantizedBlocks, jax.Array]:
    """`quantize_reordered` with error feedback: quantizes `full` (read in
    place, any float dtype) plus `residual` (fp32, shape (local, nodes, s),
    in the order of the blocks) and returns the blocks and what the
    quantization lost (fp32, the residual's shape), bit for bit as the
    reference.

    One pass: reads the input and the residual, writes the codes, the
    scales and the new residual; the sum never leaves the chip.
    """
    what = "quantize_reordered_with_feedback"
    s = _check(what, full, nodes, local, bits, block_size, rounding, scale_dtype)
    if residual.shape != (local, nodes, s):
        raise ValueError(
            f"residual has shape {residual.shape}, expected {(local, nodes, s)}: "
            "(local, nodes, chunk), the order of the blocks"
        )
    return _quantize_reordered(
        full, residual, nodes, local, bits, block_size, rounding, scale_dtype, interpret
    )


def _check(what, full, nodes, local, bits, block_size, rounding, scale_dtype) -> int:
    """Validates the arguments; returns the chunk length s."""
    _reference.check_float(full.dtype, what)
    _reference.check_block_size(block_size, bits)
    _reference.check_rounding(rounding)
    _reference.check_scale_dtype(scale_dtype)
    if full.ndim != 1 or full.shape[0] % (nodes * local):
        raise ValueError(
            f"{what} needs a 1-D vector whose length is a multiple of "
            f"{nodes * local}, got shape {full.shape}"
        )
    return full.shape[0] // (nodes * local)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _quantize_reordered(
    full, residual, nodes, local, bits, block_size, rounding, scale_dtype, interpret
):
    # Under jit, tracing both backends happens once per shape, not per call.
    static = dict(
        nodes=nodes,
        local=local,
        bits=bits,
        block_size=block_size,
        rounding=rounding,
        scale_dtype=scale_dtype,
    )
    if residual is None:
        return by_platform(
            functools.partial(_triton.quantize_reordered, **static),
            functools.partial(_reference.quantize_reordered, **static),
            interpret,
            full,
        )
    return by_platform(
        lambda full, residual, interpret: _triton.quantize_reordered(
            full, interpret=interpret, residual=residual, **static
        ),
        functools.partial(_reference.quantize_reordered_with_feedback, **static),
        interpret,
        full,
        residual,
    )
