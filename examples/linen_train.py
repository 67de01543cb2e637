"""A Linen model trained with ZeRO++: three Linen modules (embedding, one
block, head) become `ModelParts` through `linen_parts`; the block parameters
are stacked with `jax.vmap(block.init)`.

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


class Embed(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        return nn.Embed(VOCAB, D)(tokens) + pos[: tokens.shape[-1]]


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.SelfAttention(num_heads=4)(h, mask=nn.make_causal_mask(h[..., 0]))
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(h)))


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


embed, block, head = Embed(), Block(), Head()
tokens = jnp.zeros((1, SEQ), jnp.int32)
hidden = jnp.zeros((1, SEQ, D))
keys = jax.random.split(jax.random.key(0), 3)
parts = zpp.linen_parts(
    embed,
    block,
    head,
    embed.init(keys[0], tokens)["params"],
    jax.vmap(lambda k: block.init(k, hidden)["params"])(jax.random.split(keys[1], LAYERS)),
    head.init(keys[2], hidden)["params"],
)

mesh = zpp.make_mesh(nodes=2, local=4)
trainer = zpp.Trainer(parts, optax.adamw(3e-3), mesh, zpp.ZeroPPConfig())
state = trainer.init()
data = zpp.ByteDataset(zpp.stdlib_corpus(1 << 20), seq_len=SEQ)
for i in range(10):
    batch = jax.device_put(data.batch("train", i, 16, seed=0), trainer.batch_sharding())
    state, metrics = trainer.step(state, batch)
    print(f"step {i + 1}: loss {float(metrics['loss']):.4f}")
