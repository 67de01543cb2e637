"""TeraPipe: token-level pipeline parallelism (planner, cost models, runtime)."""

from zpp_jax.pipeline.cost import AnalyticCost, FittedCost, load_cost, save_cost
from zpp_jax.pipeline.decoders import PipelineDecoder, decoder_for
from zpp_jax.pipeline.planner import (
    BatchPlan,
    Plan,
    best_uniform,
    brute_force,
    latency,
    plan_batch,
    plan_tokens,
    uniform_slicing,
)
from zpp_jax.pipeline.profile import calibrate_step_overhead
from zpp_jax.pipeline.runtime import STAGE, TokenPipeline
from zpp_jax.pipeline.trainer import PipelineTrainer

__all__ = [
    "AnalyticCost",
    "BatchPlan",
    "FittedCost",
    "PipelineDecoder",
    "PipelineTrainer",
    "Plan",
    "STAGE",
    "TokenPipeline",
    "best_uniform",
    "brute_force",
    "calibrate_step_overhead",
    "decoder_for",
    "latency",
    "load_cost",
    "plan_batch",
    "plan_tokens",
    "save_cost",
    "uniform_slicing",
]
