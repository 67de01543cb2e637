"""Hugging Face checkpoints in and out: safetensors weights with their
``config.json``, one file or shards with an index.

`load(path)` builds the library's `Llama` from a checkpoint directory of a
supported family (`zpp_jax.hf.config`), every tensor checked against the
shape its config implies before any is read. With ``mesh=`` it builds the
model sharded (`zpp_jax.shard`): each process reads only the slices its
own devices hold. `save(model, path)` writes the same layout back from a
plain or sharded model: ``config.json``, ``model.safetensors`` or shards of
at most `max_shard_bytes` with ``model.safetensors.index.json``. Loading
then saving in the checkpoint's dtype gives its tensors back bit for bit.

Memory: a plain `load` holds the model on the host in fp32. A sharded one
holds, per process, its devices' blocks (fp32) plus one tensor being read
(its file pages, and its blocks before they are placed). `save` holds one
tensor at a time on the host (a sharded one is gathered tensor by tensor,
and process 0 writes).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from zpp_jax.errors import UsageError, check_creatable
from zpp_jax.hf.config import read_config
from zpp_jax.hf.files import (
    DTYPES,
    INDEX,
    TensorReader,
    plan_shards,
    remove_weights,
    shard_file_names,
    weight_files,
    write_streamed,
)
from zpp_jax.hf.model import llama_config
from zpp_jax.models.llama import Llama, LlamaConfig

# Buffers some checkpoints carry that are not parameters (recomputed here).
_IGNORED = ("rotary_emb.inv_freq",)


def tensor_names(cfg: LlamaConfig) -> list[tuple[str, tuple, bool]]:
    """(checkpoint name, parameter path in a `Llama` of unstacked layers,
    transposed) of every weight of a model of `cfg`, in the order
    checkpoints list them."""
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


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one parameter of the `Llama` lives in a checkpoint: the tensor
    of each layer (one name unless the layers are stacked for `nnx.scan`),
    stored transposed (a Linear's (out, in) weight) or not."""

    names: tuple[str, ...]
    transposed: bool
    stacked: bool

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape each of `names` has in the checkpoint, for a parameter
        of `shape`."""
        shape = tuple(shape[1:] if self.stacked else shape)
        return shape[::-1] if self.transposed else shape

    def read(self, reader: TensorReader, index: tuple[slice, ...]) -> np.ndarray:
        """The parameter's fp32 elements at `index` (slices of its own
        shape), read from the checkpoint's slices alone."""
        if not self.stacked:
            return self._read_one(reader, self.names[0], index)
        layers = range(len(self.names))[index[0]]
        return np.stack([self._read_one(reader, self.names[i], index[1:]) for i in layers])

    def _read_one(self, reader: TensorReader, name: str, index: tuple[slice, ...]) -> np.ndarray:
        value = reader.read(name, tuple(index[::-1] if self.transposed else index))
        value = np.asarray(value.T if self.transposed else value, np.float32)
        if not np.isfinite(value).all():
            raise UsageError(
                f"tensor {name} holds NaN or infinite values: the checkpoint is damaged "
                "(download it again)"
            )
        return value


# The dtypes a checkpoint's weights may be stored in (safetensors' names).
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def sources(cfg: LlamaConfig) -> dict[tuple, Source]:
    """Each parameter path of a `Llama` of `cfg` with its `Source`."""
    out: dict[tuple, Source] = {}
    for name, key, transposed in tensor_names(cfg):
        if cfg.scan and key[0] == "layers":
            key = (key[0], *key[2:])
            names = out[key].names if key in out else ()
            out[key] = Source((*names, name), transposed, stacked=True)
        else:
            out[key] = Source((name,), transposed, stacked=False)
    return out


def load(
    path: str | pathlib.Path,
    *,
    dtype: str = "float32",
    seq_len: int | None = None,
    scan: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    config=None,
) -> Llama:
    """The `Llama` of a checkpoint directory, its parameters in fp32,
    computing in `dtype` on sequences of up to `seq_len` tokens (default:
    the checkpoint's longest), its layers stacked for `nnx.scan` with
    `scan`.

    With `mesh` (a `zpp_jax.make_mesh` mesh), the model comes back sharded
    as ``zpp_jax.shard(model, mesh, config)`` shards it, built without ever
    being whole: each process reads, through safetensors' lazy slices, only
    the blocks its own devices hold. Its other state (error-feedback
    residuals) starts at zero.

    Raises:
      UsageError: a missing file, a shard the index names that is missing,
        a tensor missing or of a shape its config.json does not imply, a
        tensor the model has no place for, a tensor stored in a dtype that
        is not floating point, a config `read_config` refuses, or `config`
        without `mesh`: all checked before any tensor is read. A tensor
        holding NaN or infinite values, found as it is read.
    """
    directory = pathlib.Path(path)
    if config is not None and mesh is None:
        raise UsageError("hf.load: config= says how to shard, and needs mesh= as well")
    cfg = llama_config(read_config(directory), seq_len, dtype, scan)
    files, plan = weight_files(directory), sources(cfg)
    model = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    if mesh is not None:
        from zpp_jax.shard import shard

        shard(model, mesh, config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    flat = dict(nnx.to_flat_state(params))
    with TensorReader(files) as reader:
        _check_tensors(directory, files, plan, flat, reader)
        for key, source in plan.items():
            flat[key].set_value(_materialize(source, reader, flat[key].get_value()))
            reader.release()  # the mapped pages of one tensor at a time
    rest = jax.tree.map(_zeros, rest)
    return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())), rest)


def check(path: str | pathlib.Path) -> None:
    """Raise UsageError, as `load` would, unless `path` is a checkpoint
    `load` reads: its config, its files and every tensor's name and shape
    (read from the headers alone: no weight is read, nothing is built)."""
    directory = pathlib.Path(path)
    cfg = llama_config(read_config(directory))
    files, plan = weight_files(directory), sources(cfg)
    abstract = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    with TensorReader(files) as reader:
        _check_tensors(directory, files, plan, flat, reader)


def _check_tensors(directory, files, plan, flat, reader: TensorReader) -> None:
    """Raise UsageError unless the checkpoint holds exactly the model's
    tensors, each of the shape its config implies (headers only)."""
    wanted = {name for source in plan.values() for name in source.names}
    unknown = sorted(n for n in set(files) - wanted if not n.endswith(_IGNORED))
    if unknown:
        raise UsageError(f"{directory}: tensors the model has no place for: {', '.join(unknown)}")
    for key, source in plan.items():
        want = source.stored_shape(flat[key].get_value().shape)
        for name in source.names:
            if name not in files:
                raise UsageError(f"{directory}: the checkpoint has no tensor {name}")
            got = reader.shape(name)
            if got != want:
                raise UsageError(
                    f"{directory}: tensor {name} has shape {got}, but config.json implies {want}"
                )
            if reader.dtype(name) not in _FLOAT_DTYPES:
                raise UsageError(
                    f"{directory}: tensor {name} is stored as {reader.dtype(name)}; zpp_jax.hf "
                    f"reads floating-point weights ({', '.join(_FLOAT_DTYPES)}), not a "
                    "quantized checkpoint's: load the unquantized one"
                )


def _materialize(source: Source, reader: TensorReader, abstract: jax.ShapeDtypeStruct):
    """The parameter `abstract` describes, read from the checkpoint: whole
    on the default device, or, when it has a sharding, each addressable
    device's block alone (a block two devices share is read once)."""
    sharding = getattr(abstract, "sharding", None)
    if sharding is None:
        return jax.numpy.asarray(source.read(reader, tuple(slice(None) for _ in abstract.shape)))
    blocks: dict[tuple, np.ndarray] = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in blocks:
            blocks[key] = source.read(reader, index)
        return blocks[key]

    return jax.make_array_from_callback(abstract.shape, sharding, block)


def _zeros(leaf):
    """An abstract leaf as zeros with its sharding; anything else as it is."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    sharding = getattr(leaf, "sharding", None)
    make = jax.jit(lambda: jax.numpy.zeros(leaf.shape, leaf.dtype), out_shardings=sharding)
    return make()


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
    extra: dict | None = None,
) -> list[pathlib.Path]:
    """Write `model` (plain, or sharded by `zpp_jax.shard` or `load`) as a
    checkpoint directory at `path`, its weights in `dtype`; returns the
    files written. `extra` entries join config.json (the token ids
    a checkpoint names: ``bos_token_id``, ``eos_token_id``). Every process
    must call it; process 0 writes.

    Memory: one tensor on each process's host at a time (a sharded one is
    gathered to the host tensor by tensor); the whole model never is.

    Raises:
      UsageError: `path` holds files already (pass ``overwrite=True`` to
        replace them), is a file or cannot be written, an unknown `dtype`,
        or a model with LoRA adapters (merge them first).
    """
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    if any(isinstance(m, nnx.LoRA) for _, m in nnx.iter_modules(model)):
        raise UsageError(
            "the model has LoRA adapters, which a checkpoint has no place for: save "
            "zpp_jax.lora.merge_lora(model), whose kernels hold them"
        )
    directory = pathlib.Path(path)
    check_creatable("hf.save", directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise UsageError(f"{directory} is not empty: save into a new directory, or overwrite=True")
    if jax.process_count() > 1:  # every process has checked before process 0 writes
        multihost_utils.sync_global_devices(f"zpp-hf-save {directory}")
    tensors = _Tensors(model, dtype)
    groups = plan_shards(tensors.sizes, max_shard_bytes)
    files = [directory / name for name in shard_file_names(len(groups))]
    lead = jax.process_index() == 0
    if lead:
        directory.mkdir(parents=True, exist_ok=True)
        remove_weights(directory)  # an overwritten export's shards and index
        config = {**checkpoint_config(model.cfg, dtype), **(extra or {})}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for names, file in zip(groups, files, strict=True):
        part = {name: tensors.specs[name] for name in names}
        if lead:
            write_streamed(file, part, tensors.value)
        else:  # the gathers are collective: every process takes part
            for name in names:
                tensors.value(name)
    written = [directory / "config.json", *files]
    if len(groups) > 1:
        weight_map = {n: f.name for names, f in zip(groups, files, strict=True) for n in names}
        index = {"metadata": {"total_size": sum(tensors.sizes.values())}, "weight_map": weight_map}
        if lead:
            (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(directory / INDEX)
    return written


class _Tensors:
    """A model's parameters as the checkpoint's tensors in `dtype`: their
    stored shapes (`specs`), byte `sizes`, and each one's host `value`."""

    def __init__(self, model: Llama, dtype: str):
        cfg = model.cfg
        self._flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        self._where = {
            name: (key, layer, source)
            for key, source in sources(cfg).items()
            for layer, name in enumerate(source.names)
        }
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, _, _ in tensor_names(cfg):
            key, _, source = self._where[name]
            shape = source.stored_shape(self._flat[key].get_value().shape)
            self.specs[name] = (shape, dtype)
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        self.sizes = {n: int(np.prod(s)) * itemsize for n, (s, _) in self.specs.items()}

    def value(self, name: str) -> np.ndarray:
        """Tensor `name` on this host in fp32, as the checkpoint stores it."""
        key, layer, source = self._where[name]
        array = self._flat[key].get_value()
        if source.stacked:
            array = jax.jit(lambda a: a[layer])(array)
        host = _on_host(array)
        return host.T if source.transposed else host


def _on_host(array: jax.Array) -> np.ndarray:
    """`array` whole on this host as fp32 (gathered over the processes when
    it is split between them)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array, np.float32)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True), np.float32)
