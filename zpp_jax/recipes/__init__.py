"""Recipes: whole training runs built from the library, as `zpp train`
runs them and as scripts, benchmarks and tests call them.

* `config`: `RunConfig`, one run's settings, whose fields are also the
  flags of ``zpp train``;
* `train`: `run(cfg)` = `build` (data, model, optimizer, trainer,
  checkpoints, state), `loop` (the steps, evaluation, checkpoints) and
  `Output` (metrics, progress, plot);
* `optimizer`: the run's AdamW, its schedule's numbers kept as data;
* `corpus`: where a run's tokens come from and its tokenizer;
* `runs`: what keeps a run from being lost: its identity, the lock on its
  outputs, the metrics file.

Importing the package or `config` costs no JAX.
"""

from __future__ import annotations

from zpp_jax._lazy import lazy_exports

_EXPORTS = {
    "RunConfig": "zpp_jax.recipes.config",
    "Job": "zpp_jax.recipes.train",
    "build": "zpp_jax.recipes.train",
    "loop": "zpp_jax.recipes.train",
    "make_model": "zpp_jax.recipes.train",
    "make_optimizer": "zpp_jax.recipes.optimizer",
    "make_trainer": "zpp_jax.recipes.train",
    "run": "zpp_jax.recipes.train",
}

__getattr__, __dir__, __all__ = lazy_exports(
    __name__, _EXPORTS, ("config", "corpus", "optimizer", "runs", "train")
)
