"""Hugging Face checkpoints of Llama-family models.

* `config`: a checkpoint's ``config.json`` (transformers 4.x or 5.x) read
  into a `CheckpointConfig` (`read_config`); no JAX.
* `model`: that config as the library's `zpp_jax.models.Llama`
  (`llama_config`).
* `checkpoint`: the weights in and out (`load`, `save`, and `check`, which
  validates a checkpoint from its headers): safetensors, one file or shards
  with an index.
"""

from __future__ import annotations

from zpp_jax._lazy import lazy_exports

_EXPORTS = {
    "CheckpointConfig": "zpp_jax.hf.config",
    "Rope": "zpp_jax.hf.config",
    "parse_config": "zpp_jax.hf.config",
    "read_config": "zpp_jax.hf.config",
    "llama_config": "zpp_jax.hf.model",
    "check": "zpp_jax.hf.checkpoint",
    "load": "zpp_jax.hf.checkpoint",
    "save": "zpp_jax.hf.checkpoint",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, ("checkpoint", "config", "model"))
