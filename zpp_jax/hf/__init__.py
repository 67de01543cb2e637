"""Hugging Face checkpoints of Llama-family models.

* `config`: a checkpoint's ``config.json`` (transformers 4.x or 5.x) read
  into a `CheckpointConfig` (`read_config`).

Importing this package costs no JAX.
"""

from zpp_jax.hf.config import CheckpointConfig, Rope, parse_config, read_config

__all__ = ["CheckpointConfig", "Rope", "parse_config", "read_config"]
