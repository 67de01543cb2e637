"""Your own Flax Linen model with ZeRO++: `zpp.shard_linen` takes the module
and its variables, and the loop stays ``model.apply(...)`` and
``jax.value_and_grad`` with respect to ``variables["params"]``. Each block
of the list (``block_0``, ``block_1``) is a unit.

    python examples/linen_train.py
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zpp_jax as zpp  # noqa: E402

D, LAYERS, SEQ, VOCAB = 64, 2, 64, 256


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.SelfAttention(num_heads=4)(h, mask=nn.make_causal_mask(h[..., 0]))
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(h)))


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        x = nn.Embed(VOCAB, D)(tokens) + pos[: tokens.shape[-1]]
        for i in range(LAYERS):
            x = Block(name=f"block_{i}")(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


mesh = zpp.make_mesh(nodes=2, local=4)
model = LM()
variables = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
model, variables = zpp.shard_linen(model, variables, mesh, zpp.ZeroPPConfig())

tx = optax.adamw(3e-3)
params = variables["params"]
opt_state = zpp.on_mesh(tx.init(params), mesh)  # its step count too


@jax.jit
def train_step(params, opt_state, batch):
    def loss_fn(params):
        logits = model.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


data = zpp.data.TokenDataset(zpp.data.stdlib_corpus(1 << 20), seq_len=SEQ)
for i in range(10):
    batch = jax.device_put(data.batch("train", i, 16, seed=0), zpp.batch_sharding(mesh))
    params, opt_state, loss = train_step(params, opt_state, batch)
    print(f"step {i + 1}: loss {float(loss):.4f}")
