"""Error bounds of quantized collectives, recomputed with the reference numerics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zpp_jax import quant


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def roundtrip(x, bits, block, rounding="nearest", scale_dtype="float32"):
    """dequantize(quantize(x)) along the last axis, in fp32."""
    q = quant.quantize(x, bits, block, rounding=rounding, scale_dtype=scale_dtype)
    return quant.dequantize(q, bits, x.shape[-1])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _scales(x, bits, block, scale_dtype):
    return quant.quantize(x, bits, block, scale_dtype=scale_dtype).scales


def quant_steps(x, bits, block, scale_dtype="float32"):
    """Per-element quantization step of quantizing rows of `x` (reference numerics)."""
    scales = _scales(jnp.asarray(x, jnp.float32), bits, block, scale_dtype)
    eb = quant.effective_block_size(x.shape[-1], block, bits)
    return np.repeat(np.asarray(scales), eb, axis=-1)[..., : x.shape[-1]]


def two_rounding_bound(g, nodes, local, bits, block, rounding="nearest", scale_dtype="float32"):
    """Elementwise bound on |hierarchical_reduce_scatter - exact mean| for the
    per-device full vectors `g` (N, N*s): half a step (nearest rounding) or
    a whole step (stochastic) of each of the two quantizations every element
    goes through, recomputed with the reference numerics. Returns (N*s,) in
    the order of the reduced vector."""
    half = 0.5 if rounding == "nearest" else 1.0
    n, full = g.shape
    s = full // n
    rows = g.reshape(nodes, local, nodes, local, s).transpose(0, 1, 3, 2, 4)  # [n, l', l, m, i]
    # quantized on device (n, l'), chunk for peer l, node m
    step1 = quant_steps(rows, bits, block, scale_dtype)
    if local == 1:  # one quantization only: straight across nodes
        return (half * step1.sum(axis=(0, 1))).transpose(1, 0, 2).reshape(-1) / n
    deq1 = np.asarray(roundtrip(jnp.asarray(rows, jnp.float32), bits, block, rounding, scale_dtype))
    partial = deq1.sum(axis=1)  # on device (n, l): [n, l, m, i]
    step2 = quant_steps(partial, bits, block, scale_dtype)  # [n, l, m, i]
    b1 = half * step1.sum(axis=1).reshape(nodes, local, nodes, s).sum(axis=0)  # [l, m, i]
    b2 = half * step2.sum(axis=0) if nodes > 1 else 0.0  # [l, m, i]
    bound = (b1 + b2).transpose(1, 0, 2).reshape(-1)  # destination (m, l) order
    return bound / n
