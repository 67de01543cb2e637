"""zpp-jax: ZeRO++ (quantized, hierarchical fully-sharded data parallel) and
TeraPipe (token-level pipeline parallelism) for JAX.

The top level is what a user calls: `shard` / `shard_linen` / `unshard` /
`unshard_linen` for any Flax model and `value_and_grad` for its gradients, `ZeroPPConfig`,
the mesh helpers (`make_mesh`, `node_mesh`, `batch_sharding`, `on_mesh`),
`Trainer` and `Checkpointer`, the `LinkModel` and the `UsageError`. The
rest lives in named submodules:

* `zpp_jax.data`: datasets, tokenizers, the batch loader;
* `zpp_jax.analysis`: what a compiled step moves and how it is scheduled;
* `zpp_jax.hf`, `zpp_jax.lora`: Hugging Face checkpoints, LoRA;
* `zpp_jax.pipeline`: TeraPipe; `zpp_jax.distributed`: several hosts;
* `zpp_jax.baseline`: plain `jax.jit` with FSDP shardings, to compare with;
* `zpp_jax.lowlevel`: the engine's pieces (`ShardedLayer`, the layouts,
  `collectives`, `quant`), less stable than the rest.

Reference models live in `zpp_jax.models`. Importing the package is cheap:
each name is imported from its module (and JAX with it) on first use, so
`zpp plan` and `zpp launch` start without JAX.
"""

from __future__ import annotations

from zpp_jax._lazy import lazy_exports

__version__ = "0.1.0"

_SUBMODULES = (
    "analysis",
    "baseline",
    "collectives",
    "data",
    "distributed",
    "errors",
    "frozen",
    "hf",
    "lora",
    "lowlevel",
    "models",
    "overlap",
    "pipeline",
    "quant",
    "recipes",
    "sharded",
    "train",
)
_EXPORTS = {
    "shard": "zpp_jax.shard",
    "shard_linen": "zpp_jax.shard_linen",
    "unshard": "zpp_jax.sharded",
    "unshard_linen": "zpp_jax.shard_linen",
    "value_and_grad": "zpp_jax.sharded",
    "ZeroPPConfig": "zpp_jax.config",
    "make_mesh": "zpp_jax.mesh",
    "node_mesh": "zpp_jax.distributed",
    "batch_sharding": "zpp_jax.mesh",
    "on_mesh": "zpp_jax.mesh",
    "Trainer": "zpp_jax.train",
    "Checkpointer": "zpp_jax.checkpoint",
    "LinkModel": "zpp_jax.overlap",
    "UsageError": "zpp_jax.errors",
}
# Former top-level names: where they live now.
_MOVED = {
    "target_mesh": "zpp_jax.analysis.target_mesh",
    "ScheduleEstimate": "zpp_jax.analysis.ScheduleEstimate",
    "schedule_estimate": "zpp_jax.analysis.schedule_estimate",
    "schedule_overlap": "zpp_jax.analysis.schedule_overlap",
    "step_report": "zpp_jax.analysis.step_report",
    "JitFSDP": "zpp_jax.baseline.JitFSDP",
    "fsdp_sharding": "zpp_jax.baseline.fsdp_sharding",
    "BatchLoader": "zpp_jax.data.BatchLoader",
    "TokenDataset": "zpp_jax.data.TokenDataset",
    "make_tokenizer": "zpp_jax.data.make_tokenizer",
    "host_to_global": "zpp_jax.data.host_to_global",
    "load_text": "zpp_jax.data.load_text",
    "stdlib_corpus": "zpp_jax.data.stdlib_corpus",
    "DistributedConfig": "zpp_jax.distributed.DistributedConfig",
    "initialize": "zpp_jax.distributed.initialize",
    "cross_entropy": "zpp_jax.train.cross_entropy",
    "next_token_loss": "zpp_jax.train.next_token_loss",
    "grad": "zpp_jax.sharded.grad",
    "xla_flags": "zpp_jax.overlap.overlap_options",
    "ShardedLayer": "zpp_jax.lowlevel.ShardedLayer",
    "scan_layers": "zpp_jax.lowlevel.scan_layers",
    "stack_value_and_grad": "zpp_jax.lowlevel.stack_value_and_grad",
    "FlatLayout": "zpp_jax.lowlevel.FlatLayout",
    "ParamLayout": "zpp_jax.lowlevel.ParamLayout",
    "shard_params": "zpp_jax.lowlevel.to_primary_shards",
    "unshard_params": "zpp_jax.lowlevel.from_primary_shards",
    "shard_spec": "zpp_jax.lowlevel.primary_spec",
    "FeedbackResidual": "zpp_jax.lowlevel.FeedbackResidual",
    "default_units": "zpp_jax.lowlevel.default_units",
    "default_linen_units": "zpp_jax.lowlevel.default_linen_units",
    "ShardedLinen": "zpp_jax.lowlevel.ShardedLinen",
    "mesh_shape": "zpp_jax.lowlevel.mesh_shape",
    "make_pipeline_mesh": "zpp_jax.lowlevel.make_pipeline_mesh",
    "AXES": "zpp_jax.lowlevel.AXES",
    "NODE": "zpp_jax.lowlevel.NODE",
    "LOCAL": "zpp_jax.lowlevel.LOCAL",
    "STAGE": "zpp_jax.lowlevel.STAGE",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES, _MOVED)
