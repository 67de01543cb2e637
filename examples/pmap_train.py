"""`jax.pmap` over the local devices with the library's collectives: the
mapped axis is named `local`, the engine's sharded layers run inside the pmap
exactly as inside `jax.shard_map` (the devices form one node, so hpZ keeps a
secondary of the whole weight and qgZ quantizes gradients once).

    python examples/pmap_train.py
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zpp_jax as zpp  # noqa: E402
from zpp_jax.models.blocks import block, init_stack  # noqa: E402

n = jax.local_device_count()
layers = 4
stack = init_stack(jax.random.key(0), layers, 64, 256)
layout = zpp.lowlevel.FlatLayout.from_tree(stack, n, stacked=True)
layer = zpp.lowlevel.ShardedLayer(block, layout, zpp.ZeroPPConfig())

# Per-device primary shards: device d holds chunk d of every layer's flat vector.
shards = jax.vmap(layout.flatten)(stack).reshape(layers, n, -1).transpose(1, 0, 2)
x = jax.random.normal(jax.random.key(1), (n, 2, 32, 64))  # 2 sequences per device
opt = optax.adam(1e-3)
opt_state = jax.vmap(opt.init)(shards)


def device_step(shards, opt_state, x):
    def loss(shards):
        return jnp.mean(jnp.square(zpp.lowlevel.scan_layers(layer, shards, x) - x[:, ::-1]))

    value, grads = jax.value_and_grad(loss)(shards)  # grads: this device's shard, averaged
    updates, opt_state = opt.update(grads, opt_state, shards)
    return optax.apply_updates(shards, updates), opt_state, jax.lax.pmean(value, zpp.lowlevel.LOCAL)


step = jax.pmap(device_step, axis_name=zpp.lowlevel.LOCAL)
for i in range(10):
    shards, opt_state, loss = step(shards, opt_state, x)
    print(f"step {i + 1}: loss {float(loss[0]):.4f}")

full = jnp.asarray(shards).transpose(1, 0, 2).reshape(layers, -1)  # back to (layers, n * s)
params = jax.vmap(layout.unflatten)(full)
print(jax.tree.map(jnp.shape, params)["mlp"])
