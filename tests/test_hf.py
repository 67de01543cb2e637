"""zpp_jax.hf: Hugging Face checkpoints' config.json, as transformers 4.x
and 5.x write them, for each supported family; anything else refused in
one line that names what is supported."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import TINY, read_all, write_checkpoint

from zpp_jax.errors import UsageError
from zpp_jax.hf import CheckpointConfig, Rope, llama_config, load, parse_config, read_config, save
from zpp_jax.models import Llama, LlamaConfig
from zpp_jax.models.llama import rope_frequencies

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


def test_without_architectures_the_model_type_names_the_family():
    for config in (LLAMA2_7B, MISTRAL_7B, QWEN25_05B):
        assert parse_config({**config, "architectures": None}) == parse_config(config)


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
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "a quantized checkpoint (gptq); zpp_jax.hf reads unquantized weights",
        ),
        ({"architectures": None, "model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
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


# -- as the library's Llama -----------------------------------------------------------


def test_each_family_becomes_a_llama_config():
    qwen = llama_config(parse_config(QWEN25_05B), seq_len=128)
    assert (qwen.qkv_bias, qwen.tie_embeddings, qwen.norm_eps, qwen.head_dim) == (
        True,
        True,
        1e-6,
        64,
    )
    assert qwen.rope_theta == 1e6 and qwen.rope_scaling is None and qwen.seq_len == 128
    llama = llama_config(parse_config(LLAMA32_1B), seq_len=64, dtype="bfloat16")
    assert llama.rope_scaling == (32.0, 1.0, 4.0, 8192) and llama.dtype == "bfloat16"
    assert not llama.qkv_bias and llama.tie_embeddings and llama.head_dim == 64
    assert llama_config(parse_config(MISTRAL_7B), seq_len=4096).n_kv_heads == 8
    assert llama_config(parse_config(MISTRAL_7B)).seq_len == 4096  # the window, not 32768
    with pytest.raises(UsageError, match="window of 4096 tokens, and sequences of 8192"):
        llama_config(parse_config(MISTRAL_7B), seq_len=8192)


def test_llama3_frequencies_follow_the_per_frequency_rule():
    """Llama 3.1's scaling, written frequency by frequency as its reference
    states it: short wavelengths kept, long ones divided by the factor, the
    ones between interpolated."""
    theta, (factor, low, high, old) = 500000.0, (8.0, 1.0, 4.0, 8192)
    want = []
    for freq in theta ** (-np.arange(64, dtype=np.float32) / 64):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            want.append(freq)
        elif wavelen > old / low:
            want.append(freq / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            want.append((1 - smooth) * freq / factor + smooth * freq)
    got = rope_frequencies(64, theta, (factor, low, high, old))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32), rtol=1e-6)
    plain = np.asarray(rope_frequencies(64, theta))
    assert (np.asarray(got) < plain).any() and (np.asarray(got) == plain).any()


def test_biases_and_tied_embeddings_shape_the_model():
    """q/k/v biases are parameters of their own; a tied model has no LM
    head, and its logits are the final hidden states times the embedding."""
    cfg = LlamaConfig(qkv_bias=True, tie_embeddings=True, norm_eps=1e-5, head_size=8)
    model = Llama(cfg, nnx.Rngs(0))
    attn = model.layers[0].attn
    assert attn.q.bias is not None and attn.k.bias is not None and attn.o.bias is None
    assert attn.q.kernel.shape == (64, 4 * 8) and not hasattr(model, "lm_head")
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    x = model.embed(tokens)
    for layer in model.layers:
        x = layer(x, jnp.arange(8)[None], jnp.tril(jnp.ones((1, 8, 8), bool)))
    want = model.norm(x) @ model.embed.embedding[...].T
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(want), rtol=1e-5, atol=1e-6)


# -- weights in and out ---------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3])
def test_a_load_and_save_round_trip_is_bit_for_bit(tmp_path, shards):
    """A bf16 checkpoint (one file, or shards with an index) loaded and saved
    in bf16 again: every tensor the same bits; saved in shards of at most
    4 KiB, it is split with an index, and loads to the same parameters."""
    tensors = write_checkpoint(tmp_path / "in", shards=shards)
    model = load(tmp_path / "in")
    save(model, tmp_path / "out", dtype="bfloat16")
    got = read_all(tmp_path / "out")
    assert set(got) == set(tensors)
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype
        np.testing.assert_array_equal(got[name].view(np.uint16), value.view(np.uint16))
    assert read_config(tmp_path / "out") == read_config(tmp_path / "in")
    files = save(model, tmp_path / "sharded", dtype="bfloat16", max_shard_bytes=4096)
    assert (tmp_path / "sharded" / "model.safetensors.index.json") in files and len(files) > 3
    again = load(tmp_path / "sharded")
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_saved_model_computes_the_same_logits(tmp_path):
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=16)
    model = Llama(cfg, nnx.Rngs(3))
    save(model, tmp_path / "m")
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % 64
    np.testing.assert_array_equal(
        np.asarray(load(tmp_path / "m")(tokens)), np.asarray(model(tokens))
    )
    with pytest.raises(UsageError, match="is not empty: save into a new directory, or overwrite"):
        save(model, tmp_path / "m")
    save(model, tmp_path / "m", overwrite=True)


def test_bad_checkpoints_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(UsageError, match="has neither model.safetensors nor"):
        load(tmp_path / "empty")
    write_checkpoint(tmp_path / "missing", drop=["model.norm.weight"])
    with pytest.raises(UsageError, match="the checkpoint has no tensor model.norm.weight"):
        load(tmp_path / "missing")
    write_checkpoint(tmp_path / "extra", extra=["model.layers.9.mlp.up_proj.weight"])
    with pytest.raises(UsageError, match="no place for: model.layers.9.mlp.up_proj.weight"):
        load(tmp_path / "extra")
    write_checkpoint(tmp_path / "shape", data={**TINY, "intermediate_size": 40})
    (tmp_path / "shape" / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(
        UsageError,
        match=r"gate_proj.weight has shape \(40, 32\), but config.json implies \(48, 32\)",
    ):
        load(tmp_path / "shape")
    write_checkpoint(tmp_path / "index", shards=2)
    (tmp_path / "index" / "model-00001.safetensors").unlink()
    with pytest.raises(UsageError, match="names the shard model-00001.safetensors, which does not"):
        load(tmp_path / "index")


def _params(model):
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_a_sharded_load_reads_each_block_once_and_computes_the_same(tmp_path, monkeypatch):
    """With mesh=, every parameter comes back split as zpp.shard splits it,
    equal to the plain load; the reads add up to the model's elements once
    (each device's block alone, no tensor read whole per device); the
    logits of the sharded model in the exact mode equal the plain model's,
    and so do those of a model of stacked (scanned) layers."""
    import zpp_jax as zpp
    from zpp_jax.hf.files import TensorReader

    data = {**TINY, "hidden_size": 64, "intermediate_size": 96, "vocab_size": 128}
    write_checkpoint(tmp_path / "in", data=data, shards=2)
    plain = load(tmp_path / "in")
    read = []
    original = TensorReader.read
    monkeypatch.setattr(
        TensorReader, "read", lambda self, n, i=None: read.append(original(self, n, i)) or read[-1]
    )
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig.zero3(comm_dtype=None)
    sharded = load(tmp_path / "in", mesh=mesh, config=config)
    want = _params(plain)
    assert sum(r.size for r in read) == sum(v.size for v in want.values())
    got = dict(nnx.to_flat_state(nnx.state(sharded, nnx.Param)))
    for key, value in want.items():
        array = got[key].get_value()
        np.testing.assert_array_equal(np.asarray(array), value)
        if key == ("embed", "embedding"):
            assert array.sharding.shard_shape(array.shape) == (16, 64)
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(8, 4) % 128
    tokens = jax.device_put(tokens, zpp.batch_sharding(mesh))
    reference = np.asarray(plain(tokens))
    # fp32 round-off, relative to the largest logit (about 36): one device's
    # batch of 8 and eight devices' batches of 1 sum their products in
    # different orders (XLA:CPU picks its matmul kernel by shape), a few
    # units in the last place per layer.
    atol = 1e-5 * np.abs(reference).max()
    np.testing.assert_allclose(np.asarray(sharded(tokens)), reference, rtol=0, atol=atol)
    scanned = load(tmp_path / "in", mesh=mesh, config=config, scan=True)
    np.testing.assert_allclose(np.asarray(scanned(tokens)), reference, rtol=0, atol=atol)
    with pytest.raises(UsageError, match="config= says how to shard, and needs mesh="):
        load(tmp_path / "in", config=config)


def test_a_sharded_or_scanned_model_saves_the_same_checkpoint(tmp_path):
    """save from a model sharded by load(mesh=), and from one of stacked
    layers, writes the same tensors, bit for bit, as from the plain one."""
    import zpp_jax as zpp

    tensors = write_checkpoint(tmp_path / "in", shards=1)
    mesh = zpp.make_mesh(2, 4)
    save(load(tmp_path / "in", mesh=mesh), tmp_path / "sharded", dtype="bfloat16")
    save(load(tmp_path / "in", scan=True), tmp_path / "scanned", dtype="bfloat16")
    for out in ("sharded", "scanned"):
        got = read_all(tmp_path / out)
        assert set(got) == set(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(got[name].view(np.uint16), value.view(np.uint16))


_TWO_PROCESSES = """
import sys
from zpp_jax.distributed import initialize
initialize()
from flax import nnx
import zpp_jax as zpp
from zpp_jax import hf
model = hf.load(sys.argv[1], mesh=zpp.make_mesh(2, 4))
embedding = model.embed.embedding.get_value()
assert not embedding.is_fully_addressable  # this process holds half of it
assert sum(s.data.size for s in embedding.addressable_shards) == embedding.size // 2
hf.save(model, sys.argv[2], dtype="bfloat16", max_shard_bytes=8192)
"""


@pytest.mark.slow
def test_two_processes_load_their_halves_and_save_the_same_bits(tmp_path):
    """Loaded over 2 processes x 4 devices, each process holds half of a
    split parameter; saved again (gathered tensor by tensor, process 0
    writing shards with an index), every tensor is the same bits."""
    import subprocess
    import sys

    from zpp_jax.launch import free_port, process_env

    tensors = write_checkpoint(tmp_path / "in", shards=2)
    coordinator = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-c", _TWO_PROCESSES, str(tmp_path / "in"), str(tmp_path / "out")]
    procs = [
        subprocess.Popen(args, env=process_env(i, 2, 4, coordinator), stderr=subprocess.PIPE)
        for i in range(2)
    ]
    errors = [p.communicate(timeout=300)[1].decode()[-2000:] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    got = read_all(tmp_path / "out")
    assert set(got) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(got[name].view(np.uint16), value.view(np.uint16))
