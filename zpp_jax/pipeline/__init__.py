"""TeraPipe: token-level pipeline parallelism (planner, cost models, runtime).

Names are imported on first use: the planner and the cost models need only
NumPy, the runtime, the trainer and the profiler need JAX."""

from zpp_jax._lazy import lazy_exports

_EXPORTS = {
    "AnalyticCost": "zpp_jax.pipeline.cost",
    "FittedCost": "zpp_jax.pipeline.cost",
    "load_cost": "zpp_jax.pipeline.cost",
    "save_cost": "zpp_jax.pipeline.cost",
    "BatchPlan": "zpp_jax.pipeline.planner",
    "Plan": "zpp_jax.pipeline.planner",
    "best_uniform": "zpp_jax.pipeline.planner",
    "brute_force": "zpp_jax.pipeline.planner",
    "latency": "zpp_jax.pipeline.planner",
    "plan_batch": "zpp_jax.pipeline.planner",
    "plan_tokens": "zpp_jax.pipeline.planner",
    "uniform_slicing": "zpp_jax.pipeline.planner",
    "PipelineDecoder": "zpp_jax.pipeline.decoders",
    "decoder_for": "zpp_jax.pipeline.decoders",
    "calibrate_step_overhead": "zpp_jax.pipeline.profile",
    "STAGE": "zpp_jax.pipeline.runtime",
    "TokenPipeline": "zpp_jax.pipeline.runtime",
    "PipelineTrainer": "zpp_jax.pipeline.trainer",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
