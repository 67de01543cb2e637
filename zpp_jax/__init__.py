"""zpp-jax: ZeRO++ (quantized, hierarchical fully-sharded data parallel) and
TeraPipe (token-level pipeline parallelism) for JAX.

The engine: `shard` / `shard_linen` for any Flax model, `Trainer` and
`Checkpointer` around them, and the lower-level pieces they are built from
(`ShardedLayer`, the layouts, `collectives`, `quant`). Reference models live
in `zpp_jax.models`.
"""

from zpp_jax import collectives, distributed, pipeline, quant
from zpp_jax.checkpoint import Checkpointer
from zpp_jax.config import ZeroPPConfig
from zpp_jax.data import ByteDataset, host_to_global, load_text, stdlib_corpus
from zpp_jax.distributed import DistributedConfig, initialize, node_mesh
from zpp_jax.errors import UsageError
from zpp_jax.layer import ShardedLayer, scan_layers, stack_value_and_grad
from zpp_jax.mesh import AXES, LOCAL, NODE, STAGE, make_mesh, make_pipeline_mesh, mesh_shape
from zpp_jax.partition import FlatLayout, ParamLayout, shard_params, shard_spec, unshard_params
from zpp_jax.shard import (
    FeedbackResidual,
    batch_sharding,
    default_units,
    grad,
    on_mesh,
    shard,
    unshard,
    value_and_grad,
)
from zpp_jax.shard_linen import ShardedLinen, default_linen_units, shard_linen
from zpp_jax.step_report import step_report
from zpp_jax.train import Trainer, cross_entropy, next_token_loss

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "LOCAL",
    "NODE",
    "STAGE",
    "ByteDataset",
    "Checkpointer",
    "DistributedConfig",
    "FeedbackResidual",
    "FlatLayout",
    "ParamLayout",
    "ShardedLayer",
    "ShardedLinen",
    "Trainer",
    "UsageError",
    "ZeroPPConfig",
    "batch_sharding",
    "collectives",
    "cross_entropy",
    "default_linen_units",
    "default_units",
    "distributed",
    "grad",
    "host_to_global",
    "initialize",
    "load_text",
    "make_mesh",
    "make_pipeline_mesh",
    "mesh_shape",
    "next_token_loss",
    "node_mesh",
    "on_mesh",
    "pipeline",
    "quant",
    "scan_layers",
    "shard",
    "shard_linen",
    "shard_params",
    "shard_spec",
    "stack_value_and_grad",
    "stdlib_corpus",
    "step_report",
    "unshard",
    "unshard_params",
    "value_and_grad",
]
