"""Your own Flax NNX model with ZeRO++, in the standard NNX training loop.

The model is written as for one device (a list of layers, its own
``__call__``, dropout); `zpp.shard` makes every layer a unit whose weights
live sharded over 2 nodes x 4 emulated devices and are gathered in int8
(qwZ, hpZ), with gradients reduced in int4 (qgZ). Nothing else changes.

    python examples/nnx_train.py
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zpp_jax as zpp  # noqa: E402

VOCAB, D, SEQ = 256, 64, 64


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, D, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(D, 4 * D, rngs=rngs), nnx.gelu, nnx.Linear(4 * D, D, rngs=rngs)
        )
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.drop(self.attn(self.norm(x), mask=mask))
        return x + self.drop(self.mlp(self.norm(x)))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(2)])
        self.out = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.out(x)


mesh = zpp.make_mesh(nodes=2, local=4)
model = zpp.shard(LM(nnx.Rngs(0)), mesh, zpp.ZeroPPConfig())
optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
zpp.on_mesh(optimizer, mesh)  # its step counters too, or the step compiles twice


@nnx.jit
def train_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


data = zpp.data.TokenDataset(zpp.data.stdlib_corpus(1 << 20), seq_len=SEQ)
for i in range(10):
    batch = jax.device_put(data.batch("train", i, 16, seed=0), zpp.batch_sharding(mesh))
    print(f"step {i + 1}: loss {float(train_step(model, optimizer, batch)):.4f}")
