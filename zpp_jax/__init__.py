"""zpp-jax: ZeRO++ (quantized, hierarchical fully-sharded data parallel) and
TeraPipe (token-level pipeline parallelism) for JAX."""

from zpp_jax import collectives, quant
from zpp_jax.config import ZeroPPConfig
from zpp_jax.layer import ShardedLayer, scan_layers
from zpp_jax.mesh import AXES, LOCAL, NODE, make_mesh, mesh_shape
from zpp_jax.partition import FlatLayout, shard_params, shard_spec, unshard_params

__version__ = "0.1.0"

__all__ = [
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
    "shard_params",
    "shard_spec",
    "unshard_params",
]
