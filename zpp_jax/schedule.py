"""How the engine asks a compiler to overlap communication with compute.

One place for the XLA options the engine compiles with, per platform, and
for whether its sharded units let their gathers run ahead (`prefetch`):

* XLA:GPU schedules with its latency-hiding scheduler, which starts an
  asynchronous collective early enough to run behind independent compute,
  within a memory limit. Its collective pipeliner moves a loop's weight
  all-gather one iteration ahead (the next layer's gather behind this
  layer's compute) and its reductions one iteration behind. The units
  prefetch: their gathers wait for nothing but the shard.
* XLA:CPU runs a program in order and its collectives synchronously: no
  options, and the units tie each gather to the layer's input so that no
  more than about two layers' full weights are ever alive.
"""

from __future__ import annotations

from jax.sharding import Mesh

_GPU_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
}

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def platform(mesh: Mesh) -> str:
    """The platform of `mesh`'s devices ("cpu", "cuda", "rocm", "tpu"),
    devices that exist only as a compile target included."""
    return mesh.devices.flat[0].platform


def schedules_overlap(mesh: Mesh) -> bool:
    """Whether XLA schedules programs for `mesh` with its latency-hiding
    scheduler, collectives asynchronous (a GPU mesh)."""
    return platform(mesh) in _GPU_PLATFORMS


def prefetches(mesh: Mesh) -> bool:
    """Whether units on `mesh` let their gathers run ahead (a GPU mesh)."""
    return schedules_overlap(mesh)


# For programs whose units are all called one after another (relayed), not
# for a layer loop, where the pipelined gathers would then run beside the
# reductions instead of behind matrix multiplies:
# * up to three collectives of different kinds in flight at once (XLA's
#   default is one): in the backward pass one unit's re-gather, the next
#   unit's intra-node all-to-all and the permute across nodes of the unit
#   after that (`ShardedLayer.relayed`) each run behind the same compute
#   instead of queueing for it;
# * no combining of collectives: XLA merges same-kind collectives of
#   consecutive units below a size threshold (gathers of two layers, their
#   permutes) into one, which then waits for the later unit's input (a
#   gather) or gradient (a reduction); each unit's collective then no
#   longer runs behind its neighbour's compute, and through the relay the
#   next layer waits for both.
_UNROLLED_GPU_OPTIONS = {
    "xla_gpu_experimental_parallel_collective_overlap_limit": 3,
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
    "xla_gpu_collective_permute_combine_threshold_bytes": 0,
}


def xla_flags(mesh_or_platform: Mesh | str, unrolled: bool = False) -> dict:
    """The XLA options the engine compiles its steps with on this platform
    (a mesh or a platform name): ``jax.jit(..., compiler_options=...)``.
    Empty on CPU and TPU.

    `unrolled`: no unit of the program is a stack run by a layer loop
    (``nnx.scan``), or its layer loops are unrolled (`zpp_jax.loops`), so
    its units are relayed one after another (see `ShardedLayer.relayed`);
    on a GPU the options then let collectives of different kinds be in
    flight together, and keep each unit's collectives apart. `zpp.Trainer`
    passes it from the model it shards."""
    name = mesh_or_platform if isinstance(mesh_or_platform, str) else platform(mesh_or_platform)
    if name not in _GPU_PLATFORMS:
        return {}
    return {**_GPU_OPTIONS, **(_UNROLLED_GPU_OPTIONS if unrolled else {})}
