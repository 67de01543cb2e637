"""What a compiled training step moves and keeps.

`step_report` compiles a training program's step and reports its
collectives, the bytes a device moves per step across and inside nodes, its
peak memory (`memory_analysis()`) and, on a GPU, what each collective is
scheduled behind and XLA's own estimate of the step.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
from pathlib import Path

import jax

from zpp_jax.analysis.schedule import (
    overlap_by_kind,
    read_estimate,
    schedule_overlap,
    unhideable_by_kind,
)
from zpp_jax.mesh import devices_per_node
from zpp_jax.overlap import schedules_overlap
from zpp_jax.overlap.hlo import has_loop, summarize
from zpp_jax.overlap.links import collective_latencies_us, collective_links


def step_report(trainer, batch: dict) -> dict:
    """Compile `trainer.train_step` for `batch` (arrays or shape/dtype structs,
    nothing is run) and report its collectives, bytes per device per step
    across and inside nodes, peak memory per device, and, per collective,
    the matrix multiplies it is scheduled behind (`schedule_overlap`; none
    on CPU, whose collectives are synchronous) and whether any could be
    (`Scheduled.hideable`; those that cannot, per kind, under
    "unhideable"). On a GPU mesh, "estimate" is the scheduler's cost
    model applied to the schedule it made: the step and the communication
    it left exposed (`ScheduleEstimate`); None elsewhere, and None, with
    the reason in "estimate_withheld", for a program with a loop (its body
    would count once, not once per iteration) or a trainer without a link
    model (``links=None``: XLA priced the collectives itself). The
    trainer may be abstract (built on an ``nnx.eval_shape`` model, for a
    compile-only mesh); any `zpp_jax.program.TrainingProgram` will do (`zpp_jax.baseline.JitFSDP`,
    `zpp_jax.pipeline.PipelineTrainer`)."""
    return report_of(trainer, *compile_with_estimate(trainer, batch))


def compile_with_estimate(trainer, batch: dict) -> tuple:
    """(`trainer.train_step` compiled for `batch`, XLA's `ScheduleEstimate`
    of it on a GPU mesh whose collectives the trainer prices (its
    ``links``), else None). The compiled program runs as the step does (on
    devices that can run it), so one compile can be both timed and
    reported (`report_of`)."""
    if not schedules_overlap(trainer.mesh):
        return trainer.compile_step(batch), None
    with tempfile.TemporaryDirectory() as dump:
        options = {
            **trainer.compiler_options,
            "xla_dump_to": dump,
            "xla_dump_latency_hiding_schedule": True,
        }
        compiled = trainer.compile_step(batch, options)
        if trainer.links is None:
            return compiled, None
        local = devices_per_node(trainer.mesh)
        text = compiled.as_text()
        latencies = collective_latencies_us(text, local, trainer.links)
        return compiled, read_estimate(Path(dump), latencies, collective_links(text, local))


def report_of(trainer, compiled, estimate) -> dict:
    """`step_report`'s dict for a step `compile_with_estimate` compiled."""
    local = devices_per_node(trainer.mesh)
    text = compiled.as_text()
    withheld = None
    if estimate is not None and has_loop(text):
        estimate = None
        withheld = "the program has a loop, whose body the estimate would count once"
    elif estimate is None and schedules_overlap(trainer.mesh) and trainer.links is None:
        withheld = "no link model (links=None): the collectives' times are XLA's own, unrecorded"
    summary = summarize(text, local)
    behind = {s.name: s for s in schedule_overlap(text)}
    ma = compiled.memory_analysis()
    peak = (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        + ma.temp_size_in_bytes
        - ma.alias_size_in_bytes
    )
    return {
        "cross_node_bytes": summary.cross_node_bytes,
        "intra_node_bytes": summary.intra_node_bytes,
        "peak_memory_bytes": int(peak),
        "state_bytes": state_bytes_per_device(trainer.abstract_state()),
        "overlap": {k: list(v) for k, v in overlap_by_kind(list(behind.values())).items()},
        "unhideable": unhideable_by_kind(list(behind.values())),
        "estimate": None if estimate is None else dataclasses.asdict(estimate),
        "estimate_withheld": withheld,
        "collectives": [_entry(c, behind.get(c.name), local) for c in summary.collectives],
    }


def _entry(c, scheduled, local: int) -> dict:
    """One collective of `step_report`, with what the schedule says of it
    (`scheduled`: its `Scheduled`, or None where nothing is scheduled)."""
    op = scheduled.op if scheduled is not None else ""
    return {
        "kind": c.kind,
        "dtypes": list(c.dtypes),
        "bytes": c.result_bytes,
        "moved_bytes": c.moved_bytes,
        "replica_groups": [list(g) for g in c.groups],
        "runs": c.runs,
        "spans_nodes": c.spans_nodes(local),
        "async": scheduled is not None and scheduled.is_async,
        "behind": list(scheduled.behind) if scheduled is not None else [],
        "op": op,
        "region": region(op),
        "unit": unit_of(op),
        "hideable": scheduled is None or scheduled.hideable,
    }


def state_bytes_per_device(state) -> int:
    """Bytes of a state tree one device holds (the largest per-device
    share): of arrays, or of shape/dtype structs with shardings. Read from
    the shardings alone, so it touches no buffer (an array of another
    process's devices counts as its sharding places it)."""
    per_device: dict = {}
    for leaf in jax.tree.leaves(state):
        if getattr(leaf, "sharding", None) is None:
            continue
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            size = math.prod(
                len(range(*i.indices(n))) for i, n in zip(index, leaf.shape, strict=True)
            )
            per_device[device.id] = per_device.get(device.id, 0) + size * leaf.dtype.itemsize
    return max(per_device.values(), default=0)


_UNIT = re.compile(r"zpp_unit\[([^\]]*)\]")


def unit_of(op: str) -> str:
    """The unit an op belongs to, by the named scope its call ran under
    (`zpp_jax.unit.unit_scope`); "" outside every unit (XLA's gathers of
    parameters outside units, the optimizer's reductions)."""
    found = _UNIT.search(op)
    return found.group(1) if found else ""


def links_and_compute(estimate: dict) -> str:
    """One line of an estimate (`ScheduleEstimate` as a dict): the kernels
    alone, each link's busy time, and the Pallas kernels' share, in ms."""
    links = estimate["link_busy_us"].items()
    busy = ", ".join(f"{link} busy {us / 1e3:.2f} ms" for link, us in links)
    line = f"compute alone {estimate['compute_us'] / 1e3:.2f} ms" + (f", {busy}" if busy else "")
    if estimate["pallas_calls"]:
        how = "their bytes" if estimate["pallas_from_bytes"] else "XLA's flat cost"
        line += (
            f"; Pallas kernels {estimate['pallas_us'] / 1e3:.2f} ms of the compute "
            f"({estimate['pallas_calls']} calls, priced from {how})"
        )
    return line


def mfu(estimate: dict | None, model_flops: float) -> float | None:
    """Model FLOPs utilization of an estimated step (`ScheduleEstimate` as a
    dict): `model_flops` (one device's, per step:
    `zpp_jax.analysis.flops.training_flops`) over the step's time x the
    GPU's matrix peak. None without an estimate or a known peak."""
    if not estimate or not estimate.get("peak_matrix_flops"):
        return None
    return model_flops / (estimate["step_us"] * 1e-6 * estimate["peak_matrix_flops"])


def exposed_by_unit(collectives: list[dict]) -> dict[str, dict[str, int]]:
    """Runs per step behind no matrix multiply, per unit (its path; "" for
    what no unit owns) and per "kind region" (``all-gather gather``,
    ``all-to-all reduce``): where in the step the exposed communication
    sits. Only meaningful for a GPU mesh's scheduled program."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives:
        if c["behind"]:
            continue
        key = f"{c['kind']} {c['region']}".strip()
        by_kind = out.setdefault(c["unit"], {})
        by_kind[key] = by_kind.get(key, 0) + c["runs"]
    return out


def exposed_time_by_unit(estimate: dict) -> dict[str, dict[str, float]]:
    """Microseconds of exposed communication in a step report's
    ``estimate`` (`ScheduleEstimate.exposed_by_op`), per unit (its path; ""
    for what no unit owns) and per "kind region", largest first: where
    the step waits on the wire."""
    out: dict[str, dict[str, float]] = {}
    for op, kinds in estimate["exposed_by_op"].items():
        for kind, us in kinds.items():
            if us <= 0:
                continue
            key = f"{kind} {region(op)}".strip()
            by_kind = out.setdefault(unit_of(op), {})
            by_kind[key] = by_kind.get(key, 0.0) + us
    return dict(sorted(out.items(), key=lambda kv: -sum(kv[1].values())))


# The regions a sharded layer names (`jax.named_scope` in `zpp_jax.layer`).
_REGIONS = ("gather", "quantize", "reduce")


def region(op: str) -> str:
    """The engine's region an op name lies in: "gather" (a unit's weight
    gather), "reduce" (its gradient reduction), "quantize", or "" (anything
    else: the model's own code, the optimizer, XLA's gathers of parameters
    used outside a unit)."""
    parts = op.split("/")
    found = [r for r in _REGIONS if f"zpp_{r}" in parts]
    return found[-1] if found else ""
