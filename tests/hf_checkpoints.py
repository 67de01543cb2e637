"""Hugging Face checkpoints the tests write themselves, with safetensors
and numpy: random bf16 tensors under the family's names."""

import json

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from zpp_jax.hf import llama_config, parse_config
from zpp_jax.hf.checkpoint import tensor_names
from zpp_jax.models import Llama

TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 64,
}


def write_checkpoint(directory, data=TINY, shards=1, drop=(), extra=()):
    """A checkpoint as Hugging Face lays it out, written with safetensors and
    numpy: random bf16 tensors under the family's names."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(data))
    cfg = llama_config(parse_config(data))
    rng = np.random.default_rng(0)
    abstract = nnx.state(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))), nnx.Param)
    by_path = dict(nnx.to_flat_state(abstract))
    tensors = {}
    for name, key, transposed in tensor_names(cfg):
        shape = by_path[key].get_value().shape
        value = rng.standard_normal(shape[::-1] if transposed else shape).astype(np.float32)
        tensors[name] = value.astype(ml_dtypes.bfloat16)
    for name in drop:
        del tensors[name]
    for name in extra:
        tensors[name] = np.zeros(3, ml_dtypes.bfloat16)
    names = list(tensors)
    parts = [names[i::shards] for i in range(shards)]
    if shards == 1:
        save_file(tensors, directory / "model.safetensors")
    else:
        weight_map = {}
        for i, part in enumerate(parts):
            file = f"model-{i:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, directory / file)
            weight_map |= {n: file for n in part}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map})
        )
    return tensors


def read_all(directory):
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "numpy") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return out
