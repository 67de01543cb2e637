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

A model provides its own (``model.pipeline_decoder()``, as
`zpp_jax.models`' `GPT` and `Llama` do; `decoder_for` asks it), built from
`attend` and `write_cache`. The math of each must equal the model's own
forward pass: the pipelined loss and gradients then match the unpipelined
model's to fp32 round-off.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zpp_jax.errors import UsageError


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

    def __init__(self, n_layers: int, seq_len: int, d_model: int, dtype, kv_width: int) -> None:
        self.n_layers, self.seq_len, self.d_model = n_layers, seq_len, d_model
        self.dtype, self.kv_width = jnp.dtype(dtype), kv_width

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
    """The `PipelineDecoder` a model provides (its ``pipeline_decoder()``
    method, as `zpp_jax.models`' `GPT` and `Llama` have)."""
    provide = getattr(model, "pipeline_decoder", None)
    if not callable(provide):
        raise UsageError(
            f"{type(model).__name__} does not say how it runs as a token pipeline: give it a "
            "pipeline_decoder() method that returns its PipelineDecoder, or pass "
            "TokenPipeline(..., decoder=)"
        )
    return provide()


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


def attend(q, keys, vals, start, n_keys):
    """Causal attention of q (b, t, h, hd) at positions start.. over the
    first `n_keys` cached positions; keys/vals (b, n_keys, h, hd)."""
    t, hd = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys).astype(jnp.float32) / jnp.sqrt(hd)
    allowed = jnp.arange(n_keys)[None, :] <= (start + jnp.arange(t))[:, None]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(vals.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, vals)


def write_cache(kv, k, v, start, keys):
    """Write a slice's keys and values (b, t, width) at `start`; return the
    cache and its first `keys` positions of keys and of values."""
    kv = kv.at[0].set(lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv.dtype), start, axis=1))
    kv = kv.at[1].set(lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv.dtype), start, axis=1))
    return kv, kv[0, :, :keys].astype(k.dtype), kv[1, :, :keys].astype(v.dtype)
