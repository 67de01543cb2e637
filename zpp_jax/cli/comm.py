"""`zpp comm`: what one training step communicates and keeps, per
configuration, read from the compiled program (nothing is run).

For each configuration the model's training step is compiled on the mesh;
every collective of its HLO is listed (kind, dtypes, bytes, replica groups,
runs per step with loop trip counts, whether its group spans nodes) and the
per-device bytes per step are totalled by the ring model, across and inside
nodes. Peak memory per device comes from `memory_analysis()`, next to the
bytes of the training state one device holds (parameters, optimizer state,
error-feedback residuals). For a GPU target (compiled, not run: see
`zpp_jax.analysis.target`) each collective also shows what it is scheduled behind.
Besides the engine's configurations, "jit" is the baseline a user would
otherwise write: plain `jax.jit` with FSDP-style shardings (`JitFSDP`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zpp_jax.analysis import step_report
from zpp_jax.baseline import JitFSDP
from zpp_jax.config import ZeroPPConfig
from zpp_jax.train import Trainer

DEFAULT_CONFIGS = {
    "zero3": ZeroPPConfig.zero3(),
    "qwz": ZeroPPConfig(comm_dtype="bfloat16", hpz=False, quantize_gradients=False),
    "hpz": ZeroPPConfig.zero3(hpz=True),
    "qgz": ZeroPPConfig(comm_dtype="bfloat16", quantize_weights=False, hpz=False),
    "zeropp": ZeroPPConfig(comm_dtype="bfloat16"),
    "zeropp_ef": ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True),
}
# Methods that are not the engine's, compared with it: name -> builder.
BASELINES = {"jit": JitFSDP}


def compare(
    make_model: Callable[[], nnx.Module],
    mesh,
    batch: int,
    seq_len: int,
    configs=None,
    compute_dtype=None,
) -> list[dict]:
    """`step_report` of a language model's training step (AdamW) for each
    configuration (default: ZeRO-3, each technique alone, all three), on
    token batches of `batch` x `seq_len`. A configuration is a
    `ZeroPPConfig` (a `Trainer` of the engine) or a baseline's builder
    from `BASELINES` (reported with ``config`` ``{"baseline": name}``).
    `make_model` may build the model abstractly (``nnx.eval_shape``), as it
    must for a compile-only mesh (`zpp_jax.analysis.target_mesh`)."""
    configs = DEFAULT_CONFIGS if configs is None else configs
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    reports = []
    for name, cfg in configs.items():
        if isinstance(cfg, ZeroPPConfig):
            step = Trainer(make_model(), optax.adamw(1e-3), mesh, cfg, compute_dtype=compute_dtype)
            described = dataclasses.asdict(cfg)
        else:  # a baseline's builder (`BASELINES`)
            step = cfg(make_model(), optax.adamw(1e-3), mesh, compute_dtype=compute_dtype)
            described = {"baseline": name}
        report = step_report(step, {"inputs": tokens, "targets": tokens})
        reports.append({"name": name, "config": described, **report})
    return reports
