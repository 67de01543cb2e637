"""zpp_jax.hf: Hugging Face checkpoints' config.json, as transformers 4.x
and 5.x write them, for each supported family; anything else refused in
one line that names what is supported."""

import json
import re

import pytest

from zpp_jax.errors import UsageError
from zpp_jax.hf import CheckpointConfig, Rope, parse_config, read_config

LLAMA2_7B = {  # transformers 4.x
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": 32000,
    "hidden_act": "silu",
    "attention_bias": False,
}
LLAMA31_8B = {  # 4.x: llama3 scaling in rope_scaling
    **LLAMA2_7B,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA32_1B = {  # 5.x: rope_parameters, dtype
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "head_dim": 64,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "vocab_size": 128256,
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    "data,want",
    [
        (
            LLAMA2_7B,
            CheckpointConfig(
                "llama", 32000, 4096, 32, 32, 32, 128, 11008, 4096, 1e-5, Rope(10000.0),
                False, False, "float16", None,
            ),
        ),
        (
            LLAMA31_8B,
            CheckpointConfig(
                "llama", 128256, 4096, 32, 32, 8, 128, 14336, 131072, 1e-5,
                Rope(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), False, False, "bfloat16", None,
            ),
        ),
        (
            LLAMA32_1B,
            CheckpointConfig(
                "llama", 128256, 2048, 16, 32, 8, 64, 8192, 131072, 1e-5,
                Rope(500000.0, "llama3", 32.0, 1.0, 4.0, 8192), False, True, "bfloat16", None,
            ),
        ),
        (
            MISTRAL_7B,
            CheckpointConfig(
                "mistral", 32000, 4096, 32, 32, 8, 128, 14336, 32768, 1e-5, Rope(10000.0),
                False, False, "bfloat16", 4096,
            ),
        ),
        (
            QWEN25_05B,
            CheckpointConfig(
                "qwen2", 151936, 896, 24, 14, 2, 64, 4864, 32768, 1e-6, Rope(1000000.0),
                True, True, "bfloat16", None,
            ),
        ),
    ],
    ids=["llama2", "llama3.1", "llama3.2-5.x", "mistral", "qwen2.5"],
)  # fmt: skip
def test_each_family_is_read(data, want):
    assert parse_config(data) == want


def test_the_same_config_in_4x_and_5x_form_reads_the_same():
    legacy = {k: v for k, v in LLAMA32_1B.items() if k not in ("rope_parameters", "dtype")}
    params = dict(LLAMA32_1B["rope_parameters"])
    legacy |= {"rope_theta": params.pop("rope_theta"), "rope_scaling": params}
    legacy["torch_dtype"] = "bfloat16"
    assert parse_config(legacy) == parse_config(LLAMA32_1B)


def test_a_directory_or_its_config_file_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    assert read_config(tmp_path) == read_config(tmp_path / "config.json")
    assert read_config(tmp_path) == parse_config(QWEN25_05B)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            "GPT2LMHeadModel is not supported; zpp_jax.hf reads LlamaForCausalLM, "
            "MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (
            {"model_type": "mistral"},
            "architecture LlamaForCausalLM with model_type 'mistral'; expected model_type 'llama'",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope type 'yarn' is not supported; zpp_jax.hf reads default, llama3",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "llama3 rope scaling without low_freq_factor, high_freq_factor, "
            "original_max_position_embeddings",
        ),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"vocab_size": None}, "vocab_size must be a positive integer, got None"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ],
)
def test_what_is_not_supported_is_named(change, message):
    with pytest.raises(UsageError, match="^config.json: " + re.escape(message)):
        parse_config({**LLAMA2_7B, **change})


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(UsageError, match="config.json does not exist"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="config.json is not JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="holds list, not a JSON object"):
        read_config(tmp_path)
