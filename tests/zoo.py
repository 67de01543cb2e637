"""Models written as users write them, for the tests of `zpp.shard` and
`zpp.shard_linen`: nothing in them knows about sharding. Each family gives
a model factory, a learnable task (batches as NumPy arrays, the batch on the
leading axis) and its loss written as on one device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zpp_jax.data import TokenDataset, stdlib_corpus
from zpp_jax.models import Llama, LlamaConfig
from zpp_jax.train import cross_entropy

BATCH = 16  # 2 rows per device on 8 devices
SEQ = 24  # differs from BATCH: positions and masks are not mistaken for the batch


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    make: Callable  # seed -> nnx.Module (NNX), or seed -> (nn.Module, variables) (Linen)
    batch: Callable[[int], dict]  # step -> batch
    loss: Callable  # (model output, batch) -> scalar


# -- tasks --------------------------------------------------------------------

_TEXT = None


def _text_batch(i: int) -> dict:
    global _TEXT
    if _TEXT is None:
        _TEXT = TokenDataset(stdlib_corpus(1 << 18), SEQ)
    return _TEXT.batch("train", i, BATCH, seed=0)


def _lm_loss(logits, batch):
    return cross_entropy(logits, batch["targets"])


_TEACHER = np.random.default_rng(123).standard_normal((32, 8)).astype(np.float32)


def _regression_batch(i: int) -> dict:
    rng = np.random.default_rng(1000 + i)
    x = rng.standard_normal((BATCH, 32)).astype(np.float32)
    noise = 0.3 * rng.standard_normal((BATCH, 8)).astype(np.float32)
    return {"inputs": x, "targets": np.tanh(x @ _TEACHER / 4) + noise}


def _mse(out, batch):
    return jnp.mean(jnp.square(out - batch["targets"]))


def _image_batch(i: int) -> dict:
    """8x8x3 images, each channel shifted by its own offset; the class is
    the largest of (c0, c1, c2, -(c0 + c1 + c2)) offsets; 10% labels noisy."""
    rng = np.random.default_rng(2000 + i)
    shift = rng.standard_normal((BATCH, 1, 1, 3)).astype(np.float32)
    x = rng.standard_normal((BATCH, 8, 8, 3)).astype(np.float32) + shift
    s = shift[:, 0, 0]
    y = np.argmax(np.concatenate([s, -s.sum(axis=1, keepdims=True)], axis=1), axis=1)
    noisy = rng.random(BATCH) < 0.1
    y = np.where(noisy, rng.integers(0, 4, BATCH), y).astype(np.int32)
    return {"inputs": x, "targets": y}


def _classify(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _reverse_batch(i: int) -> dict:
    """Sequence reversal: the decoder reads the reversed source, shifted."""
    rng = np.random.default_rng(3000 + i)
    src = rng.integers(2, 34, (BATCH, SEQ)).astype(np.int32)
    tgt = src[:, ::-1]
    dec_in = np.concatenate([np.ones((BATCH, 1), np.int32), tgt[:, :-1]], axis=1)
    return {"inputs": src, "decoder_inputs": dec_in, "targets": tgt}


# -- NNX models ---------------------------------------------------------------


def llama(scan: bool) -> Family:
    cfg = LlamaConfig.preset("tiny", seq_len=SEQ, scan=scan, d_model=32, d_ff=64)
    return Family(
        f"llama_{'scan' if scan else 'list'}",
        lambda seed: Llama(cfg, nnx.Rngs(seed)),
        _text_batch,
        _lm_loss,
    )


class MLP(nnx.Module):
    """Five layers of five different widths."""

    def __init__(self, widths, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:], strict=False)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def mlp() -> Family:
    return Family(
        "mlp_5_widths",
        lambda seed: MLP([32, 64, 48, 96, 40, 8], nnx.Rngs(seed)),
        _regression_batch,
        _mse,
    )


class Attention(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.heads = heads
        self.q = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)

    def __call__(self, x, context, mask=None):
        b, t, d = x.shape
        q = self.q(x).reshape(b, t, self.heads, -1)
        k, v = jnp.split(self.kv(context).reshape(b, context.shape[1], 2 * self.heads, -1), 2, 2)
        return self.o(nnx.dot_product_attention(q, k, v, mask=mask).reshape(b, t, d))


class EncoderLayer(nnx.Module):
    def __init__(self, d, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = Attention(d, 4, rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(d, 2 * d, rngs=rngs), nnx.relu, nnx.Linear(2 * d, d, rngs=rngs)
        )

    def __call__(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h)
        return x + self.mlp(self.norm2(x))


class DecoderLayer(nnx.Module):
    def __init__(self, d, rngs):
        self.norms = nnx.List([nnx.LayerNorm(d, rngs=rngs) for _ in range(3)])
        self.self_attn, self.cross_attn = Attention(d, 4, rngs), Attention(d, 4, rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(d, 2 * d, rngs=rngs), nnx.relu, nnx.Linear(2 * d, d, rngs=rngs)
        )

    def __call__(self, y, memory, *, causal_mask):
        h = self.norms[0](y)
        y = y + self.self_attn(h, h, mask=causal_mask)
        y = y + self.cross_attn(self.norms[1](y), memory)
        return y + self.mlp(self.norms[2](y))


class EncoderDecoder(nnx.Module):
    def __init__(self, rngs, d=32, vocab=40):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, d)))
        self.encoder = nnx.List([EncoderLayer(d, rngs) for _ in range(2)])
        self.decoder = nnx.List([DecoderLayer(d, rngs) for _ in range(2)])
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, src, tgt):
        x = self.embed(src) + self.pos[...]
        for layer in self.encoder:
            x = layer(x)
        y = self.embed(tgt) + self.pos[...]
        mask = nnx.make_causal_mask(tgt)
        for layer in self.decoder:
            y = layer(y, x, causal_mask=mask)
        return self.out(y)


def encoder_decoder() -> Family:
    return Family(
        "encoder_decoder",
        lambda seed: EncoderDecoder(nnx.Rngs(seed)),
        _reverse_batch,
        _lm_loss,
    )


class TiedLM(nnx.Module):
    """The head is the embedding's transpose (`nnx.Embed.attend`)."""

    def __init__(self, rngs, d=32):
        self.embed = nnx.Embed(256, d, rngs=rngs)
        self.blocks = nnx.List([EncoderLayer(d, rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def tied() -> Family:
    return Family("tied_embedding", lambda seed: TiedLM(nnx.Rngs(seed)), _text_batch, _lm_loss)


class Residual(nnx.Module):
    def __init__(self, d, hidden, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, hidden, rngs=rngs), nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Tower(nnx.Module):
    """Residual layers of different widths, with projections between them."""

    def __init__(self, rngs):
        self.layers = nnx.List(
            [
                nnx.Linear(32, 48, rngs=rngs),
                Residual(48, 200, rngs),
                nnx.Linear(48, 24, rngs=rngs),
                Residual(24, 72, rngs),
                Residual(24, 16, rngs),
                nnx.Linear(24, 8, rngs=rngs),
            ]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def widths() -> Family:
    return Family("different_widths", lambda seed: Tower(nnx.Rngs(seed)), _regression_batch, _mse)


class MoE(nnx.Module):
    """A top-1 mixture of experts with its load-balancing statistics, as
    Switch-style layers compute them: the fraction of rows routed to each
    expert and the mean router probability of each. `returns="loss"`: the
    layer returns its load-balancing loss (a product of two batch means);
    "means": it returns the two means, and the model computes the loss."""

    def __init__(self, d, experts, rngs, returns="loss"):
        self.router = nnx.Linear(d, experts, rngs=rngs)
        self.experts = nnx.Param(jax.random.normal(rngs.params(), (experts, d, d)) * d**-0.5)
        self.returns = returns

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x))
        routed = jax.nn.one_hot(jnp.argmax(probs, -1), probs.shape[-1])
        y = x + jnp.einsum("bd,edf,be->bf", x, self.experts, routed * probs)
        means = {"routed": routed.mean(0), "probs": probs.mean(0)}
        return y, (balance_loss(means) if self.returns == "loss" else means)


def balance_loss(means):
    return means["probs"].shape[-1] * jnp.sum(means["routed"] * means["probs"])


class MoENet(nnx.Module):
    def __init__(self, rngs, returns="loss", d=16, experts=4):
        self.layers = nnx.List([MoE(d, experts, rngs, returns) for _ in range(2)])
        self.head = nnx.Linear(d, 1, rngs=rngs)
        self.returns = returns

    def __call__(self, x):
        aux = 0.0
        for layer in self.layers:
            x, stats = layer(x)
            aux = aux + (stats if self.returns == "loss" else balance_loss(stats))
        return self.head(x)[:, 0], aux


def nnx_families() -> list[Family]:
    return [llama(False), llama(True), mlp(), encoder_decoder(), tied(), widths()]


# -- Linen models -------------------------------------------------------------


class ViTBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x))
        h = nn.Dense(64)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class ViT(nn.Module):
    """Patches of 2x2, a class token, two blocks, a classifier."""

    @nn.compact
    def __call__(self, images):
        b = images.shape[0]
        x = nn.Conv(32, (2, 2), strides=(2, 2), name="patches")(images).reshape(b, -1, 32)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, 32))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, 32)), x], axis=1)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], 32))
        for i in range(2):
            x = ViTBlock(name=f"block_{i}")(x)
        return nn.Dense(4, name="head")(nn.LayerNorm()(x[:, 0]))


class ConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.relu(x)


class CNN(nn.Module):
    """Conv + BatchNorm blocks, dropout, a classifier."""

    dropout: float = 0.2

    @nn.compact
    def __call__(self, x, train: bool = True):
        for i, f in enumerate((16, 32)):
            x = ConvBlock(f, name=f"conv_{i}")(x, train)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(4, name="head")(x)


def _linen(module):
    def make(seed):
        x = jnp.zeros((1, 8, 8, 3))
        return module, module.init({"params": jax.random.key(seed)}, x)

    return make


def linen_families() -> list[Family]:
    return [
        Family("linen_vit", _linen(ViT()), _image_batch, _classify),
        Family("linen_cnn", _linen(CNN()), _image_batch, _classify),
    ]
