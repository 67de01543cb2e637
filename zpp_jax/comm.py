"""`zpp comm`: what one training step communicates and keeps, per configuration,
read from the compiled program (nothing is run).

For each configuration the GPT training step is compiled on the mesh; every
collective of its HLO is listed (kind, dtypes, bytes, replica groups, runs per
step with loop trip counts, whether its group spans nodes) and the per-device
bytes per step are totalled by the ring model, split into across and inside
nodes. Peak memory per device comes from `memory_analysis()`, next to an
analytic figure for the state (parameters, gradients, optimizer, hpZ
secondaries, error-feedback residuals; activations not counted).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from zpp_jax import quant
from zpp_jax.config import ZeroPPConfig
from zpp_jax.mesh import mesh_shape
from zpp_jax.report import summarize
from zpp_jax.train import GROUPS, Trainer

DEFAULT_CONFIGS = {
    "zero3": ZeroPPConfig.zero3(),
    "qwz": ZeroPPConfig(comm_dtype="bfloat16", hpz=False, quantize_gradients=False),
    "hpz": ZeroPPConfig.zero3(hpz=True),
    "qgz": ZeroPPConfig(comm_dtype="bfloat16", quantize_weights=False, hpz=False),
    "zeropp": ZeroPPConfig(comm_dtype="bfloat16"),
}


def analytic_state_bytes(trainer: Trainer, opt_moments: int = 2) -> int:
    """Bytes per device of the training state by formula: fp32 shards, their
    gradients, `opt_moments` fp32 optimizer moments, one hpZ secondary per
    block in the wire format, and error-feedback residuals."""
    cfg = trainer.config
    nodes, local = mesh_shape(trainer.mesh)
    total = 0
    for name in GROUPS:
        layout = trainer.layouts[name]
        count = trainer.num_layers if name == "blocks" else 1
        s = layout.shard_size
        total += count * 4 * s * (2 + opt_moments)
        if cfg.hpz:
            if cfg.quantize_weights:
                secondary = nodes * quant.wire_bytes(s, cfg.weight_bits, cfg.block_size)
            else:
                width = 4 if cfg.comm_dtype in (None, "float32") else 2
                secondary = nodes * s * width
            total += count * secondary
        if cfg.error_feedback:
            itemsize = jnp.dtype(cfg.residual_dtype).itemsize
            total += count * trainer.layers[name].residual_size(nodes, local) * itemsize
    return total


def step_report(trainer: Trainer, name: str, batch: int, seq_len: int) -> dict:
    """Compile `trainer.step` for a (batch, seq_len) batch and report it."""
    sharding = trainer.batch_sharding()
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sharding)
    compiled = trainer.step.lower(
        trainer.abstract_state(), {"inputs": tokens, "targets": tokens}
    ).compile()
    _, local = mesh_shape(trainer.mesh)
    summary = summarize(compiled.as_text(), local)
    ma = compiled.memory_analysis()
    peak = (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        + ma.temp_size_in_bytes
        - ma.alias_size_in_bytes
    )
    return {
        "name": name,
        "config": dataclasses.asdict(trainer.config),
        "cross_node_bytes": summary.cross_node_bytes,
        "intra_node_bytes": summary.intra_node_bytes,
        "peak_memory_bytes": int(peak),
        "analytic_state_bytes": analytic_state_bytes(trainer),
        "collectives": [
            {
                "kind": c.kind,
                "dtypes": list(c.dtypes),
                "bytes": c.result_bytes,
                "moved_bytes": c.moved_bytes,
                "replica_groups": [list(g) for g in c.groups],
                "runs": c.runs,
                "spans_nodes": c.spans_nodes(local),
            }
            for c in summary.collectives
        ],
    }


def compare(parts_fn, mesh, batch: int, seq_len: int, configs=None) -> list[dict]:
    """`step_report` for each configuration (default: ZeRO-3, each technique
    alone, all three). `parts_fn()` builds the model's `ModelParts`."""
    configs = DEFAULT_CONFIGS if configs is None else configs
    parts = parts_fn()
    reports = []
    for name, cfg in configs.items():
        trainer = Trainer(parts, optax.adamw(1e-3), mesh, cfg)
        reports.append(step_report(trainer, name, batch, seq_len))
    return reports
