"""Reference models: what a user brings, written with plain Flax NNX.

The engine and the pipeline never import them; the recipes, the `zpp`
command, the examples, tests and benchmarks do. Each provides its
`PipelineDecoder` (``pipeline_decoder()``) for the token pipeline.
"""

from zpp_jax.models.gpt import GPT, GPTConfig
from zpp_jax.models.llama import Llama, LlamaConfig

# arch (as `zpp train --arch` names it): (its config class, its model class)
ARCHITECTURES = {"gpt": (GPTConfig, GPT), "llama": (LlamaConfig, Llama)}


def preset(arch: str, size: str, **overrides):
    """(The config of `arch`'s `size` preset with `overrides`, the model
    class that takes it)."""
    config_class, model_class = ARCHITECTURES[arch]
    return config_class.preset(size, **overrides), model_class


__all__ = ["ARCHITECTURES", "GPT", "GPTConfig", "Llama", "LlamaConfig", "preset"]
