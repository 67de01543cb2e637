"""zpp-jax: ZeRO++ (quantized, hierarchical fully-sharded data parallel) and
TeraPipe (token-level pipeline parallelism) for JAX."""

from zpp_jax import collectives, distributed, pipeline, quant
from zpp_jax.checkpoint import Checkpointer
from zpp_jax.config import ZeroPPConfig
from zpp_jax.data import ByteDataset, host_to_global, load_text, stdlib_corpus
from zpp_jax.distributed import DistributedConfig, initialize, node_mesh
from zpp_jax.errors import UsageError
from zpp_jax.layer import ShardedLayer, scan_layers, stack_value_and_grad
from zpp_jax.mesh import AXES, LOCAL, NODE, make_mesh, mesh_shape
from zpp_jax.models.gpt import GPT, GPTConfig, cross_entropy
from zpp_jax.partition import FlatLayout, shard_params, shard_spec, unshard_params
from zpp_jax.train import ModelParts, Trainer, TrainState, linen_parts, nnx_parts

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "ByteDataset",
    "Checkpointer",
    "GPTConfig",
    "ModelParts",
    "TrainState",
    "Trainer",
    "cross_entropy",
    "DistributedConfig",
    "UsageError",
    "initialize",
    "distributed",
    "pipeline",
    "host_to_global",
    "node_mesh",
    "linen_parts",
    "load_text",
    "nnx_parts",
    "stdlib_corpus",
    "AXES",
    "LOCAL",
    "NODE",
    "FlatLayout",
    "ShardedLayer",
    "ZeroPPConfig",
    "collectives",
    "make_mesh",
    "mesh_shape",
    "quant",
    "scan_layers",
    "stack_value_and_grad",
    "shard_params",
    "shard_spec",
    "unshard_params",
]
