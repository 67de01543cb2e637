"""Helpers to run a stack of transformer blocks sharded with the engine and
unsharded as the reference."""

import jax
import jax.numpy as jnp

from zpp_jax import ShardedLayer
from zpp_jax.layer import stack_value_and_grad
from zpp_jax.models.blocks import block


def loss_fn(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def reference_loss_and_grads(stack, x):
    def loss(stack):
        h, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, stack)
        return loss_fn(h)

    return jax.value_and_grad(loss)(stack)


def sharded_loss_and_grads(mesh, config, layout, compute_dtype=None):
    """jit: (shards, x, residuals) -> (mean loss, shard grads, new residuals) of a block stack."""
    layer = ShardedLayer(block, layout, config, compute_dtype)
    f = stack_value_and_grad(layer, mesh, lambda out, x: loss_fn(out))
    return jax.jit(lambda shards, x, residuals: f(shards, residuals, x)), layer
