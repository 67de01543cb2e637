"""zpp-jax: ZeRO++ (quantized, hierarchical fully-sharded data parallel) and
TeraPipe (token-level pipeline parallelism) for JAX.

The engine: `shard` / `shard_linen` for any Flax model, `Trainer` and
`Checkpointer` around them, and the lower-level pieces they are built from
(`ShardedLayer`, the layouts, `collectives`, `quant`). Reference models live
in `zpp_jax.models`.

Importing the package is cheap: each name is imported from its module (and
JAX with it) on first use, so `zpp plan` and `zpp launch` start without JAX.
"""

from __future__ import annotations

from zpp_jax._lazy import lazy_exports

__version__ = "0.1.0"

_SUBMODULES = (
    "analysis",
    "collectives",
    "distributed",
    "errors",
    "frozen",
    "hf",
    "lora",
    "overlap",
    "pipeline",
    "quant",
    "recipes",
)
_EXPORTS = {
    "target_mesh": "zpp_jax.analysis",
    "JitFSDP": "zpp_jax.baseline",
    "fsdp_sharding": "zpp_jax.baseline",
    "Checkpointer": "zpp_jax.checkpoint",
    "ZeroPPConfig": "zpp_jax.config",
    "BatchLoader": "zpp_jax.data",
    "TokenDataset": "zpp_jax.data",
    "make_tokenizer": "zpp_jax.data",
    "host_to_global": "zpp_jax.data",
    "load_text": "zpp_jax.data",
    "stdlib_corpus": "zpp_jax.data",
    "DistributedConfig": "zpp_jax.distributed",
    "initialize": "zpp_jax.distributed",
    "node_mesh": "zpp_jax.distributed",
    "UsageError": "zpp_jax.errors",
    "ShardedLayer": "zpp_jax.layer",
    "scan_layers": "zpp_jax.layer",
    "stack_value_and_grad": "zpp_jax.layer",
    "AXES": "zpp_jax.mesh",
    "LOCAL": "zpp_jax.mesh",
    "NODE": "zpp_jax.mesh",
    "STAGE": "zpp_jax.mesh",
    "make_mesh": "zpp_jax.mesh",
    "make_pipeline_mesh": "zpp_jax.mesh",
    "mesh_shape": "zpp_jax.mesh",
    "FlatLayout": "zpp_jax.partition",
    "ParamLayout": "zpp_jax.partition",
    "shard_params": "zpp_jax.partition",
    "shard_spec": "zpp_jax.partition",
    "unshard_params": "zpp_jax.partition",
    "FeedbackResidual": "zpp_jax.shard",
    "batch_sharding": "zpp_jax.mesh",
    "default_units": "zpp_jax.shard",
    "grad": "zpp_jax.sharded",
    "on_mesh": "zpp_jax.mesh",
    "shard": "zpp_jax.shard",
    "unshard": "zpp_jax.sharded",
    "value_and_grad": "zpp_jax.sharded",
    "ShardedLinen": "zpp_jax.shard_linen",
    "default_linen_units": "zpp_jax.shard_linen",
    "shard_linen": "zpp_jax.shard_linen",
    "xla_flags": "zpp_jax.overlap",
    "LinkModel": "zpp_jax.overlap",
    "ScheduleEstimate": "zpp_jax.analysis",
    "schedule_estimate": "zpp_jax.analysis",
    "schedule_overlap": "zpp_jax.analysis",
    "step_report": "zpp_jax.analysis",
    "Trainer": "zpp_jax.train",
    "cross_entropy": "zpp_jax.train",
    "next_token_loss": "zpp_jax.train",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)
