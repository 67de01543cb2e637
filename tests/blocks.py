"""Helpers to run a stack of transformer blocks sharded with the engine and
unsharded as the reference."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zpp_jax import AXES, ShardedLayer, scan_layers, shard_spec
from zpp_jax.models.blocks import block


def loss_fn(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def reference_loss_and_grads(stack, x):
    def loss(stack):
        h, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, stack)
        return loss_fn(h)

    return jax.value_and_grad(loss)(stack)


def sharded_loss_and_grads(mesh, config, layout, compute_dtype=None):
    """jit(shard_map(...)): (mean loss, shard grads, new residuals) of a block stack."""
    layer = ShardedLayer(block, layout, config, compute_dtype)

    def local(shards, x, residuals):
        def loss(shards, residuals):
            return loss_fn(scan_layers(layer, shards, x, residuals))

        value, (g, r) = jax.value_and_grad(loss, argnums=(0, 1))(shards, residuals)
        return jax.lax.pmean(value, AXES), g, r

    spec = shard_spec(stacked=True)
    res_spec = spec if config.error_feedback else None
    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, P(AXES), res_spec),
        out_specs=(P(), spec, res_spec),
        check_vma=False,
    )
    return jax.jit(f), layer
