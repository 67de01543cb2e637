"""Helpers to run a stack of transformer blocks sharded with the engine and
unsharded as the reference."""

import functools

import jax
import jax.numpy as jnp

from zpp_jax import quant
from zpp_jax.layer import stack_value_and_grad
from zpp_jax.lowlevel import ShardedLayer
from zpp_jax.models.blocks import block


def loss_fn(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def stack_loss(stack, x):
    h, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, stack)
    return loss_fn(h)


def reference_loss_and_grads(stack, x):
    return jax.jit(jax.value_and_grad(stack_loss))(stack, x)


@functools.cache
def sharded_loss_and_grads(mesh, config, layout, compute_dtype=None):
    """jit: (shards, x, residuals) -> (mean loss, shard grads, new residuals)
    of a block stack. Cached, so tests that run the same program share one
    compilation."""
    layer = ShardedLayer(block, layout, config, compute_dtype)
    f = stack_value_and_grad(layer, mesh, lambda out, x: loss_fn(out))
    return jax.jit(lambda shards, x, residuals: f(shards, residuals, x)), layer


def used_weights(flat, layout, config):
    """The flat weights (layers, N*s) as the sharded layer computes with them:
    each device's shard dequantized from its codes (qwZ), or rounded to
    `comm_dtype`, or exact."""
    layers, n, s = flat.shape[0], layout.num_shards, layout.shard_size
    if config.quantize_weights:
        rows = flat.reshape(layers, n, s)
        q = quant.quantize(rows, config.weight_bits, config.block_size)
        return quant.dequantize(q, config.weight_bits, s).reshape(layers, n * s)
    if config.comm_dtype is not None:
        return flat.astype(config.comm_dtype).astype(jnp.float32)
    return flat


@functools.partial(jax.jit, static_argnums=(1, 2))
def per_device_flat_grads(flat, layout, n_dev, x):
    """Each device's flat fp32 weight gradient (n_dev, layers, N*s) of its own
    slice of `x`, at the flat weights `flat` (layers, N*s), unsharded."""
    stack = jax.vmap(layout.unflatten)(flat)
    xs = x.reshape(n_dev, -1, *x.shape[1:])
    grads = jax.vmap(jax.grad(stack_loss), in_axes=(None, 0))(stack, xs)
    return jax.vmap(jax.vmap(layout.flatten))(grads)
