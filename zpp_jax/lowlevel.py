"""The engine's pieces, for a caller who builds sharded layers by hand:
less stable than the top level, and free to change between versions.

* `ShardedLayer`: one layer function whose parameters live as primary
  shards, with its gather (qwZ, hpZ) and gradient reduction (qgZ);
  `scan_layers` and `stack_value_and_grad` run a stack of them.
* The layouts: `FlatLayout` (a pytree as one flat vector, split over the
  devices; `to_primary_shards`, `from_primary_shards`, `primary_spec`) and
  `ParamLayout` (each parameter split along its own dimension).
* What `zpp_jax.shard` and `zpp_jax.shard_linen` build: `default_units`,
  `default_linen_units`, `ShardedLinen`, `FeedbackResidual`.
* The mesh's axes (`NODE`, `LOCAL`, `AXES`, `STAGE`), `mesh_shape`,
  `make_pipeline_mesh`; and the modules `collectives` and `quant`.
"""

from __future__ import annotations

from zpp_jax import collectives, quant
from zpp_jax.layer import ShardedLayer, scan_layers, stack_value_and_grad
from zpp_jax.mesh import AXES, LOCAL, NODE, STAGE, make_pipeline_mesh, mesh_shape
from zpp_jax.partition import (
    FlatLayout,
    ParamLayout,
    from_primary_shards,
    primary_spec,
    to_primary_shards,
)
from zpp_jax.shard import FeedbackResidual, default_units
from zpp_jax.shard_linen import ShardedLinen, default_linen_units

__all__ = [
    "AXES",
    "LOCAL",
    "NODE",
    "STAGE",
    "FeedbackResidual",
    "FlatLayout",
    "ParamLayout",
    "ShardedLayer",
    "ShardedLinen",
    "collectives",
    "default_linen_units",
    "default_units",
    "from_primary_shards",
    "make_pipeline_mesh",
    "mesh_shape",
    "primary_spec",
    "quant",
    "scan_layers",
    "stack_value_and_grad",
    "to_primary_shards",
]
