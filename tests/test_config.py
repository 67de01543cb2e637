import dataclasses

import pytest

from zpp_jax import ZeroPPConfig
from zpp_jax.models import GPTConfig, LlamaConfig


def test_defaults_are_full_zeropp():
    c = ZeroPPConfig()
    assert c.quantize_weights and c.hpz and c.quantize_gradients
    assert (c.weight_bits, c.gradient_bits) == (8, 4)


def test_zero3_switches_everything_off():
    c = ZeroPPConfig.zero3()
    assert not (c.quantize_weights or c.hpz or c.quantize_gradients or c.error_feedback)


def test_zero3_is_the_bf16_baseline():
    assert ZeroPPConfig.zero3() == ZeroPPConfig(
        quantize_weights=False, hpz=False, quantize_gradients=False, comm_dtype="bfloat16"
    )
    assert ZeroPPConfig.zero3(comm_dtype=None).comm_dtype is None  # the exact fp32 wire
    assert ZeroPPConfig.zero3(hpz=True).hpz


def test_replace_validates_again():
    assert ZeroPPConfig().replace(gradient_bits=8).gradient_bits == 8
    with pytest.raises(ValueError, match="needs quantize_gradients=True"):
        ZeroPPConfig(error_feedback=True).replace(quantize_gradients=False)


def test_hashable_and_equal_by_value():
    # configurations key compiled programs: equal ones must hash alike
    assert ZeroPPConfig(hpz=False) == ZeroPPConfig(hpz=False)
    assert len({ZeroPPConfig(), ZeroPPConfig(), ZeroPPConfig.zero3()}) == 2


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZeroPPConfig().hpz = False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(weight_bits=2), "weight_bits=2 is not supported"),
        (dict(gradient_bits=16), "gradient_bits=16 is not supported"),
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(block_size=-4), "block_size must be a positive int"),
        (dict(block_size=255, weight_bits=4), "block_size=255 is odd"),
        (dict(gradient_block_size=33), "gradient_block_size=33 is odd"),
        (dict(gradient_block_size=0), "gradient_block_size must be a positive int"),
        (dict(gradient_block_size=None, block_size=255), "block_size=255 is odd"),
        (dict(error_feedback=True, quantize_gradients=False), "needs quantize_gradients=True"),
        (dict(residual_dtype="int8"), "residual_dtype='int8'"),
        (dict(comm_dtype="int8"), "comm_dtype='int8'"),
        (dict(hpz=1), "hpz must be a bool"),
        (dict(remat="dot"), "remat=.dot. is not supported; use one of"),
        (dict(persistence_threshold=-1), "persistence_threshold must be an int >= 0"),
        (dict(persistence_threshold=1e5), "persistence_threshold must be an int >= 0"),
        (dict(unroll_layer_loops=1), "unroll_layer_loops must be a bool"),
    ],
)
def test_bad_values_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroPPConfig(**kwargs)


def test_odd_block_is_fine_without_int4():
    assert ZeroPPConfig(block_size=255).block_size == 255
    assert ZeroPPConfig(gradient_block_size=None, gradient_bits=8, block_size=255).grad_block == 255
    with pytest.raises(ValueError, match="odd"):
        ZeroPPConfig(gradient_block_size=None).replace(block_size=33)


def test_alignment_is_the_lcm_of_active_blocks():
    assert ZeroPPConfig().alignment == 256
    assert ZeroPPConfig(block_size=96, gradient_block_size=64).alignment == 192
    assert ZeroPPConfig(quantize_weights=False).alignment == 32
    assert ZeroPPConfig.zero3().alignment == 1


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LlamaConfig(d_ff=0), "LlamaConfig.d_ff must be a positive int, got 0"),
        (lambda: LlamaConfig(n_kv_heads=3), "multiple of n_kv_heads=3"),
        (lambda: LlamaConfig(dtype="int8"), "dtype='int8': use float32"),
        (lambda: GPTConfig(n_layers=True), "GPTConfig.n_layers must be a positive int, got True"),
    ],
)
def test_model_configs_name_bad_sizes(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_gpt_refuses_sequences_longer_than_its_context():
    import jax.numpy as jnp
    from flax import nnx

    from zpp_jax.models import GPT

    cfg = GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))  # shapes only: nothing compiles

    def logits(tokens):
        return nnx.eval_shape(lambda m, t: m(t), model, tokens)

    assert logits(jnp.zeros((1, 8), jnp.int32)).shape[:2] == (1, 8)
    with pytest.raises(ValueError, match="sequences of 9 tokens exceed the GPT's context of 8"):
        logits(jnp.zeros((1, 9), jnp.int32))
