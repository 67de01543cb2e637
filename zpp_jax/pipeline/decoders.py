"""How a decoder LM runs as a token pipeline: its parts and a cached layer step.

`TokenPipeline` cuts a sequence into token slices, so each layer runs on a
slice at an offset, attending to the keys and values cached from the
slices before it. A `PipelineDecoder` says how one model family does that:

* `parts(model)`: the model's modules by name. ``"blocks"`` is the layer
  stack (a module stacked by `nnx.vmap`, or a list of identical layers);
  every other part runs outside the stages' layers (the embedding on the
  first stage, the final norm and LM head on the last) and is replicated.
* `embed(parts, tokens, start)`: the hidden states of a slice of tokens at
  positions start, start + 1, ...;
* `layer(block, x, kv, start, keys)`: one layer on a slice, reading and
  writing its cache;
* `head(parts, x)`: fp32 logits.

`decoder_for(model)` gives the built-in one for `zpp_jax.models`' `GPT` and
`Llama`. The math of each equals the model's own forward pass: the
pipelined loss and gradients match the unpipelined model's to fp32
round-off.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zpp_jax.errors import UsageError
from zpp_jax.models.gpt import GPT
from zpp_jax.models.llama import Llama, rotary


class PipelineDecoder:
    """A decoder family as the token pipeline runs it (see the module).

    Attributes: `n_layers`, `seq_len` (the longest sequence), `d_model`,
    `dtype` (compute dtype: activations and the key/value cache) and
    `kv_width` (features cached per token and layer, for keys and for values
    each)."""

    n_layers: int
    seq_len: int
    d_model: int
    dtype: Any
    kv_width: int

    def parts(self, model: nnx.Module) -> dict[str, Any]:
        raise NotImplementedError

    def embed(self, parts: dict, tokens: jax.Array, start: jax.Array) -> jax.Array:
        """(b, t) tokens at positions start.. -> (b, t, d_model). `start + t`
        may pass `seq_len` (padded slices, idle stages): those rows are never
        read, any finite value does."""
        raise NotImplementedError

    def layer(self, block, x, kv, start, keys: int):
        """One layer on x (b, t, d) at positions start..start+t-1. `kv`
        (2, b, seq_len + room, kv_width): this layer's keys and values of
        every position so far; the slice attends to positions < `keys`
        (static) and causally to itself. Returns (y, kv with the slice's
        keys and values written at start)."""
        raise NotImplementedError

    def head(self, parts: dict, x: jax.Array) -> jax.Array:
        raise NotImplementedError


def decoder_for(model: nnx.Module) -> PipelineDecoder:
    """The built-in `PipelineDecoder` of a `GPT` or a `Llama`."""
    if isinstance(model, GPT):
        return _GPTDecoder(model.cfg)
    if isinstance(model, Llama):
        return _LlamaDecoder(model.cfg)
    raise UsageError(
        f"the token pipeline runs zpp_jax.models' GPT and Llama, not {type(model).__name__}; "
        "for another decoder pass TokenPipeline(..., decoder=) a PipelineDecoder of it"
    )


def split_part(part) -> tuple:
    """(graphdef, params, rest) of a part; a list of identical layers is
    stacked along a leading layer axis, like an `nnx.vmap` stack."""
    if not isinstance(part, (list, tuple, nnx.List)):
        return nnx.split(part, nnx.Param, ...)
    splits = [nnx.split(layer, nnx.Param, ...) for layer in part]
    graphdef, _, rest = splits[0]
    shapes = [jax.tree.map(jnp.shape, s[1]) for s in splits]
    if any(s[0] != graphdef or shape != shapes[0] for s, shape in zip(splits, shapes, strict=True)):
        raise UsageError(
            "the token pipeline stacks the layers, so they must be identical in structure "
            "and shapes; these differ"
        )
    return graphdef, jax.tree.map(lambda *a: jnp.stack(a), *(s[1] for s in splits)), rest


def _attend(q, keys, vals, start, n_keys):
    """Causal attention of q (b, t, h, hd) at positions start.. over the
    first `n_keys` cached positions; keys/vals (b, n_keys, h, hd)."""
    t, hd = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys).astype(jnp.float32) / jnp.sqrt(hd)
    allowed = jnp.arange(n_keys)[None, :] <= (start + jnp.arange(t))[:, None]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(vals.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, vals)


def _write(kv, k, v, start, keys):
    """Write a slice's keys and values (b, t, width) at `start`; return the
    cache and its first `keys` positions of keys and of values."""
    kv = kv.at[0].set(lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv.dtype), start, axis=1))
    kv = kv.at[1].set(lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv.dtype), start, axis=1))
    return kv, kv[0, :, :keys].astype(k.dtype), kv[1, :, :keys].astype(v.dtype)


class _ModelsDecoder(PipelineDecoder):
    """A family of `zpp_jax.models`, its sizes read from its config."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.n_layers, self.seq_len, self.d_model = cfg.n_layers, cfg.seq_len, cfg.d_model
        self.dtype = jnp.dtype(cfg.dtype)
        self.kv_width = self._kv_width(cfg)


class _GPTDecoder(_ModelsDecoder):
    """`zpp_jax.models.gpt.GPT`: learned positions, one fused qkv matmul."""

    @staticmethod
    def _kv_width(cfg) -> int:
        return cfg.d_model

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
        kv, ks, vs = _write(kv, k, v, start, keys)
        att = _attend(
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


class _LlamaDecoder(_ModelsDecoder):
    """`zpp_jax.models.llama.Llama`: rotary positions at the slice's offset,
    grouped key/value heads (the cache holds only the n_kv_heads)."""

    @staticmethod
    def _kv_width(cfg) -> int:
        return cfg.n_kv_heads * cfg.head_dim

    def parts(self, model):
        return {
            "embed": model.embed,
            "blocks": model.layers,
            "norm": model.norm,
            "lm_head": model.lm_head,
        }

    def embed(self, parts, tokens, start):
        return parts["embed"](tokens).astype(self.dtype)

    def layer(self, blk, x, kv, start, keys):
        b, t, _ = x.shape
        cfg, attn = self.cfg, blk.attn
        hd, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        positions = jnp.broadcast_to(start + jnp.arange(t), (b, t))
        h = blk.attn_norm(x)
        q = rotary(attn.q(h).reshape(b, t, cfg.n_heads, hd), positions, cfg.rope_theta)
        k = rotary(attn.k(h).reshape(b, t, cfg.n_kv_heads, hd), positions, cfg.rope_theta)
        kv, ks, vs = _write(kv, k.reshape(b, t, -1), attn.v(h), start, keys)
        ks = jnp.repeat(ks.reshape(b, keys, cfg.n_kv_heads, hd), group, axis=2)
        vs = jnp.repeat(vs.reshape(b, keys, cfg.n_kv_heads, hd), group, axis=2)
        att = _attend(q, ks, vs, start, keys).reshape(b, t, -1)
        x = x + attn.o(att)
        return x + blk.mlp(blk.mlp_norm(x)), kv

    def head(self, parts, x):
        return parts["lm_head"](parts["norm"](x)).astype(jnp.float32)
