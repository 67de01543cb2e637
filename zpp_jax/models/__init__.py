"""Reference models: what a user brings, written with plain Flax NNX.

The engine and the pipeline never import them; the recipes, the `zpp`
command, the examples, tests and benchmarks do. Each provides its
`PipelineDecoder` (``pipeline_decoder()``) for the token pipeline.
"""

from zpp_jax.models.gpt import GPT, GPTConfig
from zpp_jax.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
