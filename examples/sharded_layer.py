"""Use the engine directly: a stack of transformer blocks trained with ZeRO++
inside your own `jax.shard_map` step, with Optax on the primary shards.

    JAX_NUM_CPU_DEVICES=8 python examples/sharded_layer.py
"""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zpp_jax as zpp
from zpp_jax.models.blocks import block, init_stack

mesh = zpp.make_mesh(nodes=2, local=4)
config = zpp.ZeroPPConfig()  # qwZ + hpZ + qgZ; ZeroPPConfig.zero3() for the baseline
# align: quantization blocks never straddle two tensors
shards, layout = zpp.lowlevel.to_primary_shards(
    init_stack(jax.random.key(0), 4, 64, 256), mesh, stacked=True, align=config.alignment
)
layer = zpp.lowlevel.ShardedLayer(block, layout, config)

x = jax.device_put(
    jax.random.normal(jax.random.key(1), (16, 32, 64)), NamedSharding(mesh, P(zpp.lowlevel.AXES))
)


def local_grads(shards, x):
    def loss(shards):
        return jnp.mean(jnp.square(zpp.lowlevel.scan_layers(layer, shards, x) - x[:, ::-1]))

    value, grads = jax.value_and_grad(loss)(shards)  # grads: this device's shard, averaged
    return jax.lax.pmean(value, zpp.lowlevel.AXES), grads


grads_fn = jax.shard_map(
    local_grads,
    mesh=mesh,
    in_specs=(zpp.lowlevel.primary_spec(stacked=True), P(zpp.lowlevel.AXES)),
    out_specs=(P(), zpp.lowlevel.primary_spec(stacked=True)),
    check_vma=False,
)
opt = optax.adamw(1e-3)
opt_state = zpp.on_mesh(opt.init(shards), mesh)  # its step count too


@jax.jit
def step(shards, opt_state):
    loss, grads = grads_fn(shards, x)
    updates, opt_state = opt.update(grads, opt_state, shards)
    return optax.apply_updates(shards, updates), opt_state, loss


for i in range(10):
    shards, opt_state, loss = step(shards, opt_state)
    print(f"step {i}: loss {float(loss):.4f}")

params = zpp.lowlevel.from_primary_shards(
    shards, layout, stacked=True
)  # the full pytree, for export
print(jax.tree.map(jnp.shape, params))
