import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpp_jax import quant

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Jitted: one compilation per shape instead of one per operation.
quantize = jax.jit(quant.quantize, static_argnums=(1, 2))
dequantize = jax.jit(quant.dequantize, static_argnums=(1, 2, 3))


def _roundtrip_error(x, bits, block):
    q = quantize(x, bits, block)
    y = dequantize(q, bits, x.shape[-1])
    xf = np.asarray(x.astype(jnp.float32))
    step = np.repeat(np.asarray(q.scales), quant.effective_block_size(x.shape[-1], block, bits), -1)
    return np.abs(np.asarray(y) - xf), step[..., : x.shape[-1]], q


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 4099])
def test_error_within_half_step(bits, dtype, n):
    x = jnp.asarray(3 * np.random.default_rng(n).standard_normal((3, n)), dtype)
    err, step, _ = _roundtrip_error(x, bits, 64)
    # Half a step, plus fp32 round-off of x / scale.
    assert np.all(err <= 0.5 * step * (1 + 1e-5) + 1e-30)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3000),
    half_block=st.integers(1, 300),
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**30),
)
def test_roundtrip_any_size(n, half_block, bits, dtype, seed):
    block = 2 * half_block
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(n), dtype)
    err, step, q = _roundtrip_error(x, bits, block)
    assert np.all(err <= 0.5 * step * (1 + 1e-5) + 1e-30)
    eb = quant.effective_block_size(n, block, bits)
    nb = -(-n // eb)
    assert q.scales.shape == (nb,)
    assert q.codes.shape == (nb, eb // 2 if bits == 4 else eb)
    assert q.codes.dtype == (jnp.uint8 if bits == 4 else jnp.int8)


def test_codes_are_round_half_to_even_and_clipped():
    # absmax 127 -> scale 1: codes are the values rounded half to even.
    x = jnp.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -127.0, 3.49])
    q = quantize(x, 8, 8)
    assert float(q.scales[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(q.codes[0]), [127, 0, 2, 2, 0, -2, -127, 3])


def test_int4_packing_layout():
    # absmax 7 -> scale 1; byte j: element j low nibble, element j + 2 high nibble.
    x = jnp.array([1.0, -2.0, 7.0, -7.0])
    q = quantize(x, 4, 4)
    assert q.codes.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(q.codes[0]), [0x71, 0x9E])
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(q.codes)), [[1, -2, 7, -7]])


def test_padding_does_not_affect_real_part():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(100), jnp.float32)
    a = dequantize(quantize(x, 8, 64), 8, 100)
    b = dequantize(quantize(jnp.pad(x, (0, 28)), 8, 64), 8, 128)[:100]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_block_gives_zeros(bits, dtype):
    x = jnp.concatenate([jnp.zeros(64), jnp.linspace(-1, 1, 64)]).astype(dtype)
    q = quantize(x, bits, 64)
    y = np.asarray(dequantize(q, bits, 128))
    assert float(q.scales[0]) == 0.0
    assert np.all(y[:64] == 0) and np.all(np.isfinite(y))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("n, block, where", [(128, 64, 70), (4096, 256, 5), (3000, 256, 2999)])
def test_non_finite_block_comes_out_nan(bits, bad, n, block, where):
    x = np.linspace(-1, 1, n).astype(np.float32)
    x[where] = bad
    y = np.array(dequantize(quantize(jnp.asarray(x), bits, block), bits, n))
    b = where // block
    assert np.all(np.isnan(y[b * block : (b + 1) * block]))  # the whole block holding it
    y[b * block : (b + 1) * block] = 0
    assert np.all(np.isfinite(y))  # other blocks untouched


def test_output_dtype():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(50), jnp.float32)
    q = quantize(x, 8, 16)
    for dt in DTYPES:
        assert dequantize(q, 8, 50, dt).dtype == dt


def test_wire_bytes():
    assert quant.wire_bytes(1000, 8, 256) == 4 * 256 + 4 * 4
    assert quant.wire_bytes(1000, 4, 256) == 4 * 128 + 4 * 4
    assert quant.wire_bytes(10, 4, 256) == 5 + 4  # one block of its own length
    assert quant.wire_bytes(1000, 4, 32, scale_bytes=2) == 32 * 16 + 2 * 32


def test_bad_input():
    x = jnp.ones(8)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        quant.quantize(x, 3, 8)
    with pytest.raises(ValueError, match="block_size=7 is odd"):
        quant.quantize(x, 4, 7)
    with pytest.raises(ValueError, match="positive"):
        quant.quantize(x, 8, 0)
    with pytest.raises(ValueError, match="int32"):
        quant.quantize(jnp.ones(8, jnp.int32), 8, 8)
