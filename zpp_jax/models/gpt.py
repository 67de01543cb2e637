"""A decoder-only GPT (causal attention, pre-norm) in Flax NNX.

Three parts: `embed` (tokens -> hidden), `blocks` (identical blocks whose
parameters are stacked along a leading layer axis by `nnx.vmap`, run under
`nnx.scan`), and `head` (final norm + LM head -> logits). Nothing in it
knows about sharding: `zpp_jax.shard` makes the embedding, the stack (one
gather per layer) and the head its units.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zpp_jax.errors import UsageError, check_positive_ints
from zpp_jax.pipeline.decoders import PipelineDecoder, attend, write_cache

_PRESETS = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, d_ff=256, seq_len=64),
    "small": dict(d_model=256, n_layers=4, n_heads=4, d_ff=1024, seq_len=128),
    "125m": dict(d_model=768, n_layers=18, n_heads=12, d_ff=3072, seq_len=1024),
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model sizes. `dtype` is the compute dtype; parameters are always fp32."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_positive_ints(
            self, ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"), "GPTConfig."
        )
        if self.d_model % self.n_heads:
            raise UsageError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise UsageError(f"dtype={self.dtype!r}: use float32, bfloat16 or float16")

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """`tiny` (tests), `small`, `125m` (benchmarks: ~127M parameters)."""
        if name not in _PRESETS:
            raise UsageError(f"unknown model size {name!r}; choose one of {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    def num_params(self) -> int:
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        block = 4 * d + 3 * d * d + 3 * d + d * d + d + d * f + f + f * d + d
        return v * d + self.seq_len * d + self.n_layers * block + 2 * d + d * v + v


class Embed(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.tokens = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, embedding_init=init, rngs=rngs
        )
        self.positions = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model)))
        self.dtype = cfg.dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t, context = tokens.shape[-1], self.positions.shape[0]
        if t > context:
            raise UsageError(
                f"sequences of {t} tokens exceed the GPT's context of {context} positions; "
                "build the model with a longer GPTConfig(seq_len=...) or cut the sequences"
            )
        return self.tokens(tokens) + self.positions[...][:t].astype(self.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)
        d, dt = cfg.d_model, cfg.dtype
        self.n_heads = cfg.n_heads
        self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dt, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=init, dtype=dt, rngs=rngs)
        self.proj = nnx.Linear(d, d, kernel_init=out_init, dtype=dt, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dt, rngs=rngs)
        self.fc = nnx.Linear(d, cfg.d_ff, kernel_init=init, dtype=dt, rngs=rngs)
        self.out = nnx.Linear(cfg.d_ff, d, kernel_init=out_init, dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        hd = d // self.n_heads
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.n_heads, hd) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        att = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        x = x + self.proj(att).astype(x.dtype)
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)))).astype(x.dtype)


class Head(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, dtype=cfg.dtype, rngs=rngs)
        self.lm = nnx.Linear(
            cfg.d_model,
            cfg.vocab_size,
            kernel_init=nnx.initializers.normal(0.02),
            dtype=cfg.dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lm(self.ln(x)).astype(jnp.float32)


class GPT(nnx.Module):
    """`GPT(cfg, rngs)(tokens) -> logits` (fp32), unsharded."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.head = Head(cfg, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return self.head(run(self.embed(tokens), self.blocks))

    def pipeline_decoder(self) -> GPTDecoder:
        """How this model runs as a token pipeline (`zpp_jax.pipeline`)."""
        return GPTDecoder(self.cfg)


class GPTDecoder(PipelineDecoder):
    """`zpp_jax.models.gpt.GPT`: learned positions, one fused qkv matmul."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.n_layers, cfg.seq_len, cfg.d_model, cfg.dtype, cfg.d_model)
        self.cfg = cfg

    def parts(self, model):
        return {"embed": model.embed, "blocks": model.blocks, "head": model.head}

    def embed(self, parts, tokens, start):
        emb, t = parts["embed"], tokens.shape[1]
        positions = jnp.pad(emb.positions[...], ((0, t), (0, 0)))  # room past the sequence
        pos = lax.dynamic_slice_in_dim(positions, start, t, axis=0)
        return (emb.tokens(tokens) + pos.astype(emb.dtype)).astype(self.dtype)

    def layer(self, blk, x, kv, start, keys):
        b, t, d = x.shape
        nh = blk.n_heads
        q, k, v = jnp.split(blk.qkv(blk.ln1(x)), 3, axis=-1)
        kv, ks, vs = write_cache(kv, k, v, start, keys)
        att = attend(
            q.reshape(b, t, nh, -1),
            ks.reshape(b, keys, nh, -1),
            vs.reshape(b, keys, nh, -1),
            start,
            keys,
        ).reshape(b, t, d)
        x = x + blk.proj(att).astype(x.dtype)
        return x + blk.out(jax.nn.gelu(blk.fc(blk.ln2(x)))).astype(x.dtype), kv

    def head(self, parts, x):
        return parts["head"](x)
