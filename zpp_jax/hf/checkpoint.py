"""Hugging Face checkpoints in and out: safetensors weights with their
``config.json``, one file or shards with an index.

`load(path)` builds the library's `Llama` from a checkpoint directory of a
supported family (`zpp_jax.hf.config`), every tensor checked against the
shape its config implies. `save(model, path)` writes the same layout back:
``config.json``, ``model.safetensors`` or shards of at most
`max_shard_bytes` with ``model.safetensors.index.json``. Loading then
saving in the checkpoint's dtype gives its tensors back bit for bit.

Memory: `load` reads one tensor at a time, and holds the whole model on the
host; `save` copies each parameter to the host once.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from zpp_jax.errors import UsageError
from zpp_jax.hf.config import read_config
from zpp_jax.hf.model import llama_config
from zpp_jax.models.llama import Llama, LlamaConfig

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Buffers some checkpoints carry that are not parameters (recomputed here).
_IGNORED = ("rotary_emb.inv_freq",)


def tensor_names(cfg: LlamaConfig) -> list[tuple[str, tuple, bool]]:
    """(checkpoint name, parameter path in the `Llama`, transposed) of every
    weight of a model of `cfg`, in the order checkpoints list them."""
    names = [("model.embed_tokens.weight", ("embed", "embedding"), False)]
    for i in range(cfg.n_layers):
        p, layer = f"model.layers.{i}.", ("layers", i)
        for ours in ("q", "k", "v", "o"):
            names.append(
                (f"{p}self_attn.{ours}_proj.weight", (*layer, "attn", ours, "kernel"), True)
            )
            if cfg.qkv_bias and ours != "o":
                names.append(
                    (f"{p}self_attn.{ours}_proj.bias", (*layer, "attn", ours, "bias"), False)
                )
        for ours in ("gate", "up", "down"):
            names.append((f"{p}mlp.{ours}_proj.weight", (*layer, "mlp", ours, "kernel"), True))
        names.append((f"{p}input_layernorm.weight", (*layer, "attn_norm", "scale"), False))
        names.append((f"{p}post_attention_layernorm.weight", (*layer, "mlp_norm", "scale"), False))
    names.append(("model.norm.weight", ("norm", "scale"), False))
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", ("lm_head", "kernel"), True))
    return names


def _weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each tensor's file: from the index, or the one weights file."""
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: directory / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise UsageError(f"{index} names the shard {file.name}, which does not exist")
        return files
    single = directory / WEIGHTS
    if not single.is_file():
        raise UsageError(f"{directory} has neither {WEIGHTS} nor {INDEX}")
    with safe_open(single, "numpy") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - not a dict


def load(path: str | pathlib.Path, *, dtype: str = "float32", seq_len: int | None = None) -> Llama:
    """The `Llama` of a checkpoint directory, its parameters in fp32,
    computing in `dtype` on sequences of up to `seq_len` tokens (default:
    the checkpoint's longest).

    Raises:
      UsageError: a missing file, a shard the index names that is missing,
        a tensor missing or of a shape its config.json does not imply, a
        tensor the model has no place for, or a config `read_config` refuses.
    """
    directory = pathlib.Path(path)
    cfg = llama_config(read_config(directory), seq_len, dtype)
    files = _weight_files(directory)
    names = tensor_names(cfg)
    unknown = sorted(set(files) - {n for n, _, _ in names})
    unknown = [n for n in unknown if not n.endswith(_IGNORED)]
    if unknown:
        raise UsageError(f"{directory}: tensors the model has no place for: {', '.join(unknown)}")
    abstract = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    by_path = dict(nnx.to_flat_state(params))
    missing = [name for name, _, _ in names if name not in files]
    if missing:
        raise UsageError(f"{directory}: the checkpoint has no tensor {missing[0]}")
    with contextlib.ExitStack() as stack:
        # Each file opened once, however many tensors it holds.
        opened = {f: stack.enter_context(safe_open(f, "numpy")) for f in set(files.values())}
        for name, key, transposed in names:
            tensor = opened[files[name]].get_tensor(name)
            want = tuple(by_path[key].get_value().shape)
            want = want[::-1] if transposed else want
            if tensor.shape != want:
                raise UsageError(
                    f"{directory}: tensor {name} has shape {tensor.shape}, but config.json "
                    f"implies {want}"
                )
            value = tensor.T if transposed else tensor
            by_path[key].set_value(jax.numpy.asarray(value.astype(np.float32)))
    return nnx.merge(graphdef, nnx.from_flat_state(list(by_path.items())), rest)


def checkpoint_config(cfg: LlamaConfig, dtype: str) -> dict:
    """The ``config.json`` of a model of `cfg` saved in `dtype`: a Qwen2 when
    it has q/k/v biases, else a Llama."""
    qwen = cfg.qkv_bias
    scaling = None
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        **({} if qwen else {"attention_bias": False, "mlp_bias": False}),
    }


def save(
    model: Llama,
    path: str | pathlib.Path,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> list[pathlib.Path]:
    """Write `model` as a checkpoint directory at `path`, its weights in
    `dtype`; returns the files written.

    Raises:
      UsageError: `path` holds files already (pass ``overwrite=True`` to
        replace them), or an unknown `dtype`.
    """
    if dtype not in _DTYPES:
        raise UsageError(f"dtype {dtype!r}: choose one of {sorted(_DTYPES)}")
    directory = pathlib.Path(path)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise UsageError(f"{directory} is not empty: save into a new directory, or overwrite=True")
    directory.mkdir(parents=True, exist_ok=True)
    by_path = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for name, key, transposed in tensor_names(model.cfg):
        value = np.asarray(by_path[key].get_value(), np.float32)
        tensors[name] = np.ascontiguousarray(value.T if transposed else value).astype(
            _DTYPES[dtype]
        )
    written = [directory / "config.json"]
    written[0].write_text(json.dumps(checkpoint_config(model.cfg, dtype), indent=2) + "\n")
    return written + _write_shards(directory, tensors, max_shard_bytes)


def _write_shards(directory: pathlib.Path, tensors: dict, max_shard_bytes: int) -> list:
    """The tensors in one file, or in shards of at most `max_shard_bytes`
    (a larger tensor alone) with an index."""
    shards: list[dict] = [{}]
    for name, value in tensors.items():
        size = sum(v.nbytes for v in shards[-1].values())
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = value
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], directory / WEIGHTS, metadata=metadata)
        return [directory / WEIGHTS]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        file = directory / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, file, metadata=metadata)
        files.append(file)
        weight_map |= {name: file.name for name in shard}
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*files, directory / INDEX]
