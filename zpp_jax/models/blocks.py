"""A pre-norm causal transformer block as a pure function of (params, x).

The unit the engine shards: one `ShardedLayer` per block, blocks stacked
under `lax.scan`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zpp_jax.errors import UsageError


def init_block(key: jax.Array, d_model: int, d_ff: int, dtype=jnp.float32) -> dict:
    """Parameters of one block: two layer norms, fused QKV, output and MLP weights."""
    ks = jax.random.split(key, 6)

    def dense(k, shape):
        return (jax.random.normal(k, shape) / np.sqrt(shape[0])).astype(dtype)

    def bias(k, n):
        return (0.1 * jax.random.normal(k, (n,))).astype(dtype)

    return {
        "ln1": {"scale": jnp.ones((d_model,), dtype), "bias": jnp.zeros((d_model,), dtype)},
        "attn": {
            "qkv": dense(ks[0], (d_model, 3 * d_model)),
            "out": dense(ks[1], (d_model, d_model)),
        },
        "ln2": {"scale": jnp.ones((d_model,), dtype), "bias": jnp.zeros((d_model,), dtype)},
        "mlp": {
            "w1": dense(ks[2], (d_model, d_ff)),
            "b1": bias(ks[3], d_ff),
            "w2": dense(ks[4], (d_ff, d_model)),
            "b2": bias(ks[5], d_model),
        },
    }


def init_stack(key: jax.Array, layers: int, d_model: int, d_ff: int, dtype=jnp.float32) -> dict:
    """`layers` blocks stacked along a leading axis (for `lax.scan`)."""
    return jax.vmap(lambda k: init_block(k, d_model, d_ff, dtype))(jax.random.split(key, layers))


def layer_norm(p: dict, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mu).mean(-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def block(p: dict, x: jax.Array, num_heads: int = 2) -> jax.Array:
    """x: (batch, tokens, d_model) -> same shape; causal self-attention + GELU MLP."""
    b, t, d = x.shape
    if d % num_heads:
        raise UsageError(f"d_model={d} is not divisible by num_heads={num_heads}")
    dt = p["attn"]["qkv"].dtype
    h = layer_norm(p["ln1"], x).astype(dt)
    q, k, v = jnp.split(h @ p["attn"]["qkv"], 3, axis=-1)
    heads = lambda a: a.reshape(b, t, num_heads, d // num_heads)
    att = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)).astype(jnp.float32)
    att = att / np.sqrt(d // num_heads)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e30)
    probs = jax.nn.softmax(att, -1).astype(dt)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, heads(v)).reshape(b, t, d)
    x = x + (o @ p["attn"]["out"]).astype(x.dtype)
    h = layer_norm(p["ln2"], x).astype(dt)
    m = jax.nn.gelu(h @ p["mlp"]["w1"] + p["mlp"]["b1"]) @ p["mlp"]["w2"] + p["mlp"]["b2"]
    return x + m.astype(x.dtype)
