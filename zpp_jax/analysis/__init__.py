"""Reading compiled programs: what a step moves, keeps and overlaps.

* `collectives_in_hlo`, `summarize`: the collectives of an HLO text, their
  bytes by the ring model, across and inside nodes (from
  `zpp_jax.overlap.hlo`, which the engine's ordering reads them with too).
* `schedule`: what each collective of a scheduled GPU program runs behind
  (`schedule_overlap`) and XLA's own estimate of the step
  (`schedule_estimate`).
* `report`: `step_report`, all of it for a training program's step.
* `compile_with_links`: a step compiled with each collective priced on
  the links it crosses (from `zpp_jax.overlap.links`, as the engine
  compiles its steps).
* `flops`: a model's FLOPs (its matrix multiplies, from its jaxpr) and a
  GPU's matrix peak, for MFU (`training_flops`, `peak_matrix_flops`).
* `target`: a mesh of GPUs that exist only as a compile target
  (`target_mesh`).

Nothing in the engine imports this package.
"""

from zpp_jax.analysis.flops import matmul_flops, peak_matrix_flops, training_flops
from zpp_jax.analysis.report import state_bytes_per_device, step_report
from zpp_jax.analysis.schedule import (
    Scheduled,
    ScheduleEstimate,
    overlap_by_kind,
    schedule_estimate,
    schedule_overlap,
    unhideable_by_kind,
)
from zpp_jax.analysis.target import has_cuda_plugin, target_mesh
from zpp_jax.overlap.hlo import Collective, CommSummary, collectives_in_hlo, summarize
from zpp_jax.overlap.links import compile_with_links

__all__ = [
    "Collective",
    "CommSummary",
    "ScheduleEstimate",
    "Scheduled",
    "collectives_in_hlo",
    "compile_with_links",
    "has_cuda_plugin",
    "matmul_flops",
    "overlap_by_kind",
    "peak_matrix_flops",
    "schedule_estimate",
    "schedule_overlap",
    "state_bytes_per_device",
    "step_report",
    "summarize",
    "target_mesh",
    "training_flops",
    "unhideable_by_kind",
]
