"""A Llama-style decoder in Flax NNX, written as a user writes one.

RMSNorm, rotary position embeddings, a SwiGLU MLP, grouped-query attention
(fewer key/value heads than query heads) and an untied LM head. The layers
are a Python list (`nnx.List`) called in a loop, or, with ``scan=True``, one
stacked module (`nnx.vmap`) run by `nnx.scan`. Nothing in it knows about
sharding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from zpp_jax.errors import UsageError, check_positive_ints
from zpp_jax.pipeline.decoders import PipelineDecoder, attend, write_cache

_PRESETS = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, seq_len=64),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=768, seq_len=128),
    # Llama 2 7B's shapes (6.74e9 parameters), for compiling, not for this
    # machine's memory.
    "7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        d_ff=11008,
        seq_len=4096,
        dtype="bfloat16",
    ),
    # Llama 3 70B's shapes (7.06e10 parameters; grouped-query attention, 8
    # key-value heads), for compiling.
    "70b": dict(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=28672,
        seq_len=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
        dtype="bfloat16",
    ),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model sizes. `dtype` is the compute dtype; parameters are fp32."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 192
    rope_theta: float = 10000.0
    dtype: str = "float32"
    scan: bool = False
    # What published checkpoints of the family vary (`zpp_jax.hf`):
    norm_eps: float = 1e-6  # added to the mean square in RMSNorm
    head_size: int | None = None  # features per head; None: d_model // n_heads
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    tie_embeddings: bool = False  # the LM head is the embedding, transposed
    # Llama 3.1's rope scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None: plain rotary frequencies.
    rope_scaling: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
        check_positive_ints(self, sizes, "LlamaConfig.")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise UsageError(f"dtype={self.dtype!r}: use float32, bfloat16 or float16")
        if self.head_size is None and self.d_model % self.n_heads:
            raise UsageError(f"d_model={self.d_model} must split into {self.n_heads} heads")
        if self.head_dim % 2:
            raise UsageError(f"heads of {self.head_dim} features: rotary needs an even size")
        if self.rope_scaling is not None and len(self.rope_scaling) != 4:
            raise UsageError(
                "rope_scaling must be (factor, low_freq_factor, high_freq_factor, "
                f"original_max_position_embeddings), got {self.rope_scaling!r}"
            )
        if self.n_heads % self.n_kv_heads:
            raise UsageError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """`tiny` (tests), `small`, `7b` (Llama 2 7B's shapes) or `70b` (Llama 3
        70B's)."""
        if name not in _PRESETS:
            raise UsageError(f"unknown model size {name!r}; choose one of {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_size is None else self.head_size


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((d,)))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


def rope_frequencies(half: int, theta: float, scaling=None) -> jax.Array:
    """The rotary frequency of each of `half` feature pairs: theta^(-i/half);
    with `scaling` (Llama 3.1's factor, low and high frequency factors and
    original context), the long wavelengths divided by the factor and the
    middle ones interpolated between, as Llama 3.1 defines them."""
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return freq
    factor, low, high, original = scaling
    wavelen = 2 * jnp.pi / freq
    scaled = jnp.where(wavelen > original / low, freq / factor, freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, smoothed, scaled)


def rotary(x, positions, theta: float, scaling=None):
    """Rotate pairs of features of x (batch, tokens, heads, head_dim) by
    their position times a per-pair frequency (`rope_frequencies`)."""
    half = x.shape[-1] // 2
    freq = rope_frequencies(half, theta, scaling)
    angle = positions[..., None].astype(jnp.float32) * freq  # (batch, tokens, half)
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, hd, dt = cfg.d_model, cfg.head_dim, cfg.dtype
        init = nnx.initializers.normal(0.02)
        kw = dict(use_bias=False, kernel_init=init, dtype=dt, rngs=rngs)
        qkv = {**kw, "use_bias": cfg.qkv_bias}
        self.q = nnx.Linear(d, cfg.n_heads * hd, **qkv)
        self.k = nnx.Linear(d, cfg.n_kv_heads * hd, **qkv)
        self.v = nnx.Linear(d, cfg.n_kv_heads * hd, **qkv)
        self.o = nnx.Linear(cfg.n_heads * hd, d, **kw)
        self.cfg = cfg

    def __call__(self, x, positions, mask):
        b, t, _ = x.shape
        cfg, hd = self.cfg, self.cfg.head_dim
        rope = (cfg.rope_theta, cfg.rope_scaling)
        q = rotary(self.q(x).reshape(b, t, cfg.n_heads, hd), positions, *rope)
        k = rotary(self.k(x).reshape(b, t, cfg.n_kv_heads, hd), positions, *rope)
        v = self.v(x).reshape(b, t, cfg.n_kv_heads, hd)
        group = cfg.n_heads // cfg.n_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1))


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        kw = dict(use_bias=False, kernel_init=init, dtype=cfg.dtype, rngs=rngs)
        self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, **kw)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, **kw)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, **kw)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """``Llama(cfg, rngs)(tokens, positions=None, mask=None) -> logits``
    (fp32). `positions` default to 0..t-1, `mask` (batch, t, t) to causal."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=nnx.initializers.normal(0.02),
            dtype=cfg.dtype,
            rngs=rngs,
        )
        if cfg.scan:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return DecoderLayer(cfg, rngs)

            self.layers = make(rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(
                cfg.d_model,
                cfg.vocab_size,
                use_bias=False,
                kernel_init=nnx.initializers.normal(0.02),
                dtype=cfg.dtype,
                rngs=rngs,
            )

    def __call__(self, tokens, positions=None, mask=None):
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        if mask is None:
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        x = self.embed(tokens)
        if self.cfg.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0, None, None), out_axes=nnx.Carry)
            def run(x, layer, positions, mask):
                return layer(x, positions, mask)

            x = run(x, self.layers, positions, mask)
        else:
            for layer in self.layers:
                x = layer(x, positions, mask)
        return _logits(self.embed, getattr(self, "lm_head", None), self.norm(x))

    def pipeline_decoder(self) -> LlamaDecoder:
        """How this model runs as a token pipeline (`zpp_jax.pipeline`)."""
        return LlamaDecoder(self.cfg)


def _logits(embed, lm_head, h) -> jax.Array:
    """fp32 logits of the final hidden states `h` (after the norm): the LM
    head's, or with tied embeddings (no `lm_head`) the embedding's transpose."""
    return (embed.attend(h) if lm_head is None else lm_head(h)).astype(jnp.float32)


class LlamaDecoder(PipelineDecoder):
    """`zpp_jax.models.llama.Llama`: rotary positions at the slice's offset,
    grouped key/value heads (the cache holds only the n_kv_heads)."""

    def __init__(self, cfg) -> None:
        super().__init__(
            cfg.n_layers, cfg.seq_len, cfg.d_model, cfg.dtype, cfg.n_kv_heads * cfg.head_dim
        )
        self.cfg = cfg

    def parts(self, model):
        parts = {"embed": model.embed, "blocks": model.layers, "norm": model.norm}
        if not self.cfg.tie_embeddings:
            parts["lm_head"] = model.lm_head
        return parts

    def embed(self, parts, tokens, start):
        return parts["embed"](tokens).astype(self.dtype)

    def layer(self, blk, x, kv, start, keys):
        b, t, _ = x.shape
        cfg, attn = self.cfg, blk.attn
        hd, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))
        h = blk.attn_norm(x)
        rope = (cfg.rope_theta, cfg.rope_scaling)
        q = rotary(attn.q(h).reshape(b, t, cfg.n_heads, hd), positions, *rope)
        k = rotary(attn.k(h).reshape(b, t, cfg.n_kv_heads, hd), positions, *rope)
        kv, ks, vs = write_cache(kv, k.reshape(b, t, -1), attn.v(h), start, keys)
        ks = jnp.repeat(ks.reshape(b, keys, cfg.n_kv_heads, hd), group, axis=2)
        vs = jnp.repeat(vs.reshape(b, keys, cfg.n_kv_heads, hd), group, axis=2)
        att = attend(q, ks, vs, start, keys).reshape(b, t, -1)
        x = x + attn.o(att)
        return x + blk.mlp(blk.mlp_norm(x)), kv

    def head(self, parts, x):
        return _logits(parts["embed"], parts.get("lm_head"), parts["norm"](x))
