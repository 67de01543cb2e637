"""A Hugging Face checkpoint's ``config.json``, read into one description.

`read_config(path)` reads the config of a Llama-family checkpoint (Llama 2,
3, 3.1 and 3.2, Mistral, Qwen2 and Qwen2.5) as transformers 4.x writes it
(``rope_theta``, ``rope_scaling``, ``torch_dtype``) or as 5.x does
(``rope_parameters``, ``dtype``), into a `CheckpointConfig`: the sizes, the
rotary embedding (`Rope`, default or ``llama3`` scaling), q/k/v biases and
tied embeddings. Anything else (another architecture, another rope type, an
MLP bias, another activation) is a `UsageError` that names what is
supported. Nothing but the JSON is read; no JAX.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

from zpp_jax.errors import UsageError, read_json_object

# architecture -> (model_type, default rms_norm_eps, q/k/v biases)
FAMILIES = {
    "LlamaForCausalLM": ("llama", 1e-6, None),
    "MistralForCausalLM": ("mistral", 1e-6, False),
    "Qwen2ForCausalLM": ("qwen2", 1e-6, True),
}
ROPE_TYPES = ("default", "llama3")
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary embedding: base `theta`; with ``type="llama3"``, Llama 3.1's
    frequency scaling (`factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position`)."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position: int | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """What a Llama-family checkpoint's ``config.json`` says of its model."""

    family: str  # "llama", "mistral" or "qwen2"
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_positions: int
    norm_eps: float
    rope: Rope
    qkv_bias: bool
    tie_embeddings: bool
    dtype: str | None  # the dtype the weights were saved in, if it says
    sliding_window: int | None  # attention window, None: every position
    eos_token_id: int | None = None  # the id that ends a sequence (the first, if several)


def read_config(path: str | pathlib.Path) -> CheckpointConfig:
    """The `CheckpointConfig` of a checkpoint directory (its ``config.json``)
    or of a ``config.json`` file.

    Raises:
      UsageError: no such file, not JSON, or a config `parse_config` refuses.
    """
    path = pathlib.Path(path)
    file = path / "config.json" if path.is_dir() else path
    if file.is_file() and file.suffix != ".json":
        raise UsageError(
            f"{file} is a file of the checkpoint, not its config.json: pass the checkpoint's "
            f"directory ({file.parent})"
        )
    if not file.is_file():
        raise UsageError(f"{file} does not exist: a Hugging Face checkpoint has a config.json")
    return parse_config(read_json_object(file), str(file))


def parse_config(data: dict, source: str = "config.json") -> CheckpointConfig:
    """A `CheckpointConfig` from a parsed ``config.json`` (`source` names it
    in errors)."""
    if not isinstance(data, dict):
        raise UsageError(f"{source} holds {type(data).__name__}, not a JSON object")
    family, default_eps, bias = _family(data, source)
    _check_supported(data, source)
    n_heads = _int(data, "num_attention_heads", source)
    d_model = _int(data, "hidden_size", source)
    head_dim = _int(data, "head_dim", source) if data.get("head_dim") else d_model // n_heads
    n_kv_heads = (
        _int(data, "num_key_value_heads", source) if "num_key_value_heads" in data else n_heads
    )
    if n_heads % n_kv_heads:
        raise UsageError(
            f"{source}: num_key_value_heads {n_kv_heads} does not divide "
            f"num_attention_heads {n_heads}"
        )
    qkv_bias = bool(data.get("attention_bias", False)) if bias is None else bias
    return CheckpointConfig(
        family=family,
        vocab_size=_int(data, "vocab_size", source),
        d_model=d_model,
        n_layers=_int(data, "num_hidden_layers", source),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=int(head_dim),
        d_ff=_int(data, "intermediate_size", source),
        max_positions=_int(data, "max_position_embeddings", source),
        norm_eps=_positive(data.get("rms_norm_eps", default_eps), "rms_norm_eps", source),
        rope=_rope(data, source),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        dtype=data.get("dtype") or data.get("torch_dtype"),
        sliding_window=_sliding_window(data, family),
        eos_token_id=_first_id(data.get("eos_token_id")),
    )


def _first_id(value) -> int | None:
    """An id of config.json, given as one int or a list of them."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _family(data: dict, source: str) -> tuple:
    """(model_type, default rms_norm_eps, q/k/v biases) of the checkpoint's
    architecture; without ``architectures``, of its ``model_type``, as
    transformers reads it."""
    architectures = data.get("architectures") or [
        name for name, (kind, _, _) in FAMILIES.items() if kind == data.get("model_type")
    ]
    supported = ", ".join(sorted(FAMILIES))
    known = [a for a in architectures if a in FAMILIES]
    if not known:
        named = ", ".join(map(str, architectures)) or f"model_type {data.get('model_type')!r}"
        raise UsageError(f"{source}: {named} is not supported; zpp_jax.hf reads {supported}")
    family, eps, bias = FAMILIES[known[0]]
    if data.get("model_type", family) != family:
        raise UsageError(
            f"{source}: architecture {known[0]} with model_type {data['model_type']!r}; "
            f"expected model_type {family!r}"
        )
    return family, eps, bias


def _check_supported(data: dict, source: str) -> None:
    quantized = data.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise UsageError(
            f"{source}: a quantized checkpoint ({method}); zpp_jax.hf reads unquantized "
            "weights: use the model's unquantized checkpoint (zpp quantizes frozen weights "
            "itself, with --frozen-bits)"
        )
    if data.get("mlp_bias"):
        raise UsageError(f"{source}: mlp_bias=true is not supported (the MLP has no biases)")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"{source}: hidden_act {act!r} is not supported; the MLP is SwiGLU (silu)")


def _int(data: dict, key: str, source: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _positive(value, key: str, source: str) -> float:
    """`value` as a float, if it is a finite number above zero."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise UsageError(f"{source}: {key} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise UsageError(f"{source}: {key} must be finite, got {value!r}")
    return float(value)


def _rope(data: dict, source: str) -> Rope:
    """The rotary embedding, from 5.x's ``rope_parameters`` or 4.x's
    ``rope_theta`` and ``rope_scaling``."""
    params = data.get("rope_parameters")
    if params is None:
        params = dict(data.get("rope_scaling") or {})
        params.setdefault("rope_theta", data.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UsageError(
            f"{source}: rope type {rope_type!r} is not supported; zpp_jax.hf reads "
            f"{', '.join(ROPE_TYPES)}"
        )
    theta = _positive(
        params.get("rope_theta", data.get("rope_theta", 10000.0)), "rope_theta", source
    )
    if rope_type == "default":
        return Rope(theta)
    missing = [k for k in _LLAMA3 if k not in params]
    if missing:
        raise UsageError(f"{source}: llama3 rope scaling without {', '.join(missing)}")
    factors = [_positive(params[k], k, source) for k in _LLAMA3[:3]]
    return Rope(theta, "llama3", *factors, _int(params, _LLAMA3[3], source))


def _sliding_window(data: dict, family: str) -> int | None:
    """The attention window, where the family uses one (Mistral's; Qwen2's
    when ``use_sliding_window`` is on); None otherwise."""
    window = data.get("sliding_window")
    if family == "qwen2" and not data.get("use_sliding_window", False):
        return None
    return int(window) if window else None
