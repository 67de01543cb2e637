"""Logical names of the reference models' parameter dimensions, as MaxText
names them, and the rules that put them on a tensor-parallel `model` axis.

The models are written without sharding, so that they are built and run on
any device without a mesh. `name_axes` attaches the names afterwards, as
sharding metadata (``out_sharding``), for `zpp.shard` to read: with
`TENSOR_PARALLEL_RULES` the Llama's attention heads, key-value heads and MLP
hidden units, and both models' vocabulary, are split over `model`
(Megatron's column and row splits). The GPT's attention is left whole on
every model rank: its fused q/k/v kernel has no head dimension to split.
"""

from __future__ import annotations

from flax import nnx

from zpp_jax.errors import UsageError

TENSOR_PARALLEL_RULES = (
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("embed", None),
)

# By the end of a parameter's path: its dimensions' names (one layer's).
_NAMES = {
    ("embed", "embedding"): ("vocab", "embed"),  # Llama
    ("tokens", "embedding"): ("vocab", "embed"),  # GPT
    ("q", "kernel"): ("embed", "heads"),
    ("k", "kernel"): ("embed", "kv_heads"),
    ("v", "kernel"): ("embed", "kv_heads"),
    ("q", "bias"): ("heads",),
    ("k", "bias"): ("kv_heads",),
    ("v", "bias"): ("kv_heads",),
    ("o", "kernel"): ("heads", "embed"),
    ("gate", "kernel"): ("embed", "mlp"),
    ("up", "kernel"): ("embed", "mlp"),
    ("down", "kernel"): ("mlp", "embed"),
    ("fc", "kernel"): ("embed", "mlp"),
    ("fc", "bias"): ("mlp",),
    ("out", "kernel"): ("mlp", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("lm", "kernel"): ("embed", "vocab"),
    ("lm", "bias"): ("vocab",),
}


def name_axes(model: nnx.Module) -> nnx.Module:
    """`model` (a reference GPT or Llama, or a LoRA over one), its
    parameters given their dimensions' logical names as sharding metadata,
    in place; a stack's leading layer axis is named None. Moves no data.
    Returns the same module."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = _NAMES.get(tuple(str(k) for k in path[-2:]))
        if names is None:
            continue
        ndim = len(var.get_value().shape)
        if ndim < len(names):
            raise UsageError(f"parameter {path} has {ndim} dimensions; its names are {names}")
        var.set_metadata("out_sharding", (None,) * (ndim - len(names)) + names)
    return model


def check_heads(config, degree: int) -> None:
    """Raise UsageError unless tensor parallelism of `degree` divides the
    model's query and key-value heads (a Llama's; a GPT splits no head)."""
    heads = [getattr(config, name, None) for name in ("n_heads", "n_kv_heads")]
    if degree > 1 and hasattr(config, "n_kv_heads") and any(h % degree for h in heads):
        raise UsageError(
            f"a tensor-parallel degree of {degree} does not divide the model's {heads[0]} query "
            f"and {heads[1]} key-value heads; use a degree that divides both"
        )
