"""TeraPipe: token-level pipeline parallelism (planner and cost models)."""

from zpp_jax.pipeline.cost import AnalyticCost, FittedCost, load_cost, save_cost
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

__all__ = [
    "AnalyticCost",
    "BatchPlan",
    "FittedCost",
    "Plan",
    "best_uniform",
    "brute_force",
    "latency",
    "load_cost",
    "plan_batch",
    "plan_tokens",
    "save_cost",
    "uniform_slicing",
]
