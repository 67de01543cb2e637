"""How the engine asks a compiler to overlap communication with compute.

One place for the XLA options the engine compiles with, per platform, and
for whether its sharded units let their gathers run ahead (`prefetch`):

* XLA:GPU schedules with its latency-hiding scheduler, which starts an
  asynchronous collective early enough to run behind independent compute,
  within a memory limit. Its collective pipeliner moves a loop's weight
  all-gather one iteration ahead (the next layer's gather behind this
  layer's compute) and its reductions one iteration behind. The units
  prefetch: their gathers wait for nothing but the shard.
* XLA's scheduler gives every asynchronous collective the same latency
  (its approximate estimator), whatever its bytes and whichever links it
  crosses. `zpp_jax.overlap.links.compile_with_links` compiles a step once more with a latency
  profile that prices each collective on the links it crosses
  (`LinkModel`), as `Trainer.compile_step` does.
* XLA:CPU runs a program in order and its collectives synchronously: no
  options, and the units tie each gather to the layer's input so that no
  more than about two layers' full weights are ever alive.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from zpp_jax._compat import known_compile_options
from zpp_jax.errors import UsageError, check_positive_finite

# The collective pipeliner on for every kind it moves (XLA's default leaves
# all-gathers and all-reduces to its optimization effort).
_PIPELINED = "COLLECTIVE_PIPELINING_MODE_ON"
_GPU_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_pipeline_all_gather": _PIPELINED,
    "xla_gpu_pipeline_reduce_scatter": _PIPELINED,
    "xla_gpu_pipeline_all_reduce": _PIPELINED,
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


def overlap_options(mesh_or_platform: Mesh | str, unrolled: bool = False) -> dict:
    """The XLA options the engine compiles its steps with on this platform
    (a mesh or a platform name): ``jax.jit(..., compiler_options=...)``.
    Empty on CPU and TPU.

    `unrolled`: no unit of the program is a stack run by a layer loop
    (``nnx.scan``), or its layer loops are unrolled (`zpp_jax.overlap.loops`), so
    its units are relayed one after another (see `ShardedLayer.relayed`);
    on a GPU the options then let collectives of different kinds be in
    flight together, and keep each unit's collectives apart. `zpp.Trainer`
    passes it from the model it shards. An option this jaxlib's XLA lacks
    is left out, with a warning (`zpp_jax._compat.known_compile_options`)."""
    name = mesh_or_platform if isinstance(mesh_or_platform, str) else platform(mesh_or_platform)
    if name not in _GPU_PLATFORMS:
        return {}
    return known_compile_options({**_GPU_OPTIONS, **(_UNROLLED_GPU_OPTIONS if unrolled else {})})


# -- what each collective costs on the links it crosses ---------------------------


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """The links of a GPU cluster as the engine describes them to XLA's
    latency-hiding scheduler, which otherwise gives every collective the
    same latency: a gradient step across the nodes' NICs looks as short as
    a small one over NVLink, and the scheduler may close it behind a few
    small kernels instead of a matrix multiply.

    intra_node_gbps: GB/s one GPU sends to the other GPUs of its node
      (NVLink; an H200 has 450 GB/s each way).
    cross_node_gbps: GB/s one GPU sends to other nodes (its share of the
      NICs; one 400 Gb/s NIC per GPU is 50 GB/s).
    latency_us: the fixed cost of one collective (launch and one exchange
      over its group), whatever its size.

    A collective then costs ``latency_us + bytes sent / bandwidth`` (the
    bytes of `zpp_jax.analysis.Collective.moved_bytes`, one device's
    share by the ring model); the scheduler keeps its own estimate of
    every kernel.
    """

    intra_node_gbps: float = 400.0
    cross_node_gbps: float = 45.0
    latency_us: float = 25.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_positive_finite(f"LinkModel.{field.name}", getattr(self, field.name), "number")

    def cost_us(self, moved_bytes: float, spans_nodes: bool) -> float:
        """Microseconds one collective sending `moved_bytes` per device takes."""
        gbps = self.cross_node_gbps if spans_nodes else self.intra_node_gbps
        return self.latency_us + moved_bytes / (gbps * 1e3)


# An H200 node of 8 GPUs, one 400 Gb/s NIC per GPU.
DEFAULT_LINKS = LinkModel()


def check_links(links) -> None:
    """Raise UsageError unless `links` is a `LinkModel` or None."""
    if links is not None and not isinstance(links, LinkModel):
        raise UsageError(f"links must be a zpp.LinkModel or None, got {links!r}")
