"""Reference models: what a user brings, written with plain Flax NNX.

The engine never imports them; the `zpp` command, the examples, tests and
benchmarks do.
"""

from zpp_jax.models.gpt import GPT, GPTConfig
from zpp_jax.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
