"""The Pallas kernels against the plain-JAX reference: bit for bit in
interpret mode, and lowering for CUDA from this CPU-only machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from zpp_jax import quant

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SETTINGS = settings(max_examples=12, deadline=None)


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        x, y = np.asarray(x), np.asarray(y)
        if jnp.issubdtype(x.dtype, jnp.floating):  # bits equal, any NaN equals any NaN
            nan = np.isnan(x.astype(np.float32))
            np.testing.assert_array_equal(nan, np.isnan(y.astype(np.float32)))
            x, y = x.copy(), y.copy()
            x[nan], y[nan] = 0, 0
            x, y = x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
        np.testing.assert_array_equal(x, y)


def _data(seed, shape, dtype, specials):
    x = np.array(3 * jax.random.normal(jax.random.key(seed), shape), np.float32)
    flat = x.reshape(-1)
    if specials and flat.size > 8:
        rng = np.random.default_rng(seed)
        zero_at = rng.integers(0, flat.size - 4)
        flat[zero_at : zero_at + min(300, flat.size - zero_at)] = 0  # an all-zero block
        flat[rng.integers(0, flat.size)] = rng.choice([np.nan, np.inf, -np.inf])
    return jnp.asarray(x).astype(dtype)


blocks = st.sampled_from([2, 6, 64, 100, 256])
sizes = st.integers(1, 1500)


@SETTINGS
@given(
    n=sizes,
    lead=st.integers(1, 3),
    block=blocks,
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from(DTYPES),
    specials=st.booleans(),
    seed=st.integers(0, 999),
)
def test_quantize_and_dequantize_bitwise(n, lead, block, bits, dtype, specials, seed):
    x = _data(seed, (lead, n), dtype, specials)
    q = pk.quantize(x, bits, block, interpret=True)
    _same(q, quant.quantize(x, bits, block))
    out = DTYPES[seed % 3]
    _same(pk.dequantize(q, bits, n, out, interpret=True), quant.dequantize(q, bits, n, out))


@SETTINGS
@given(
    k=st.integers(1, 4),
    size=sizes,
    block=blocks,
    bits=st.sampled_from([4, 8]),
    with_residual=st.booleans(),
    specials=st.booleans(),
    seed=st.integers(0, 999),
)
def test_dequantize_sum_quantize_bitwise(k, size, block, bits, with_residual, specials, seed):
    q = quant.quantize(_data(seed, (k, 2, size), jnp.float32, specials), bits, block)
    residual = _data(seed + 1, (2, size), jnp.float32, False) * 0.1 if with_residual else None
    ref = pk.dequantize_sum_quantize(q, bits, size, residual)
    _same(pk.dequantize_sum_quantize(q, bits, size, residual, interpret=True), ref)
    # and the reference is what its docstring says
    total = sum(
        quant.dequantize(quant.QuantizedBlocks(q.codes[j], q.scales[j]), bits, size)
        for j in range(k)
    )
    eb = q.codes.shape[-1] * (2 if bits == 4 else 1)
    if residual is not None:
        total = total + residual
    _same(ref[0], quant.quantize(total, bits, eb))


@SETTINGS
@given(
    shape=st.sampled_from([(1, 8), (2, 4), (4, 2), (8, 1), (2, 2)]),
    s=st.integers(1, 700),
    block=blocks,
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 999),
)
def test_quantize_reordered_bitwise(shape, s, block, bits, dtype, seed):
    nodes, local = shape
    full = _data(seed, (nodes * local * s,), dtype, True)
    q = pk.quantize_reordered(full, nodes, local, bits, block, interpret=True)
    rows = full.reshape(nodes, local, s).swapaxes(0, 1)
    _same(q, quant.quantize(rows, bits, block))
    assert q.codes.shape[:2] == (local, nodes)


def test_aligned_multi_tile_sizes():
    # Sizes that are multiples of the tile (no padding path) and several tiles long.
    x = _data(7, (3, 256 * 96), jnp.bfloat16, True)
    for bits in (4, 8):
        q = pk.quantize(x, bits, 256, interpret=True)
        _same(q, quant.quantize(x, bits, 256))
        _same(
            pk.dequantize(q, bits, x.shape[-1], jnp.bfloat16, interpret=True),
            quant.dequantize(q, bits, x.shape[-1], jnp.bfloat16),
        )


def _lowered_for(f, args, platform):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


OPS = {
    "quantize8": (lambda x: pk.quantize(x, 8, 256), lambda: (jnp.ones((4, 1000), jnp.bfloat16),)),
    "quantize4": (lambda x: pk.quantize(x, 4, 64), lambda: (jnp.ones((1000,), jnp.float16),)),
    "dequantize4": (
        lambda q: pk.dequantize(q, 4, 1000, jnp.bfloat16),
        lambda: (quant.quantize(jnp.ones((4, 1000)), 4, 64),),
    ),
    "dequantize8": (
        lambda q: pk.dequantize(q, 8, 1000),
        lambda: (quant.quantize(jnp.ones(1000), 8, 256),),
    ),
    "dequantize_sum_quantize": (
        lambda q, r: pk.dequantize_sum_quantize(q, 4, 512, r),
        lambda: (quant.quantize(jnp.ones((4, 2, 512)), 4, 64), jnp.zeros((2, 512))),
    ),
    "quantize_reordered": (
        lambda x: pk.quantize_reordered(x, 2, 4, 4, 64),
        lambda: (jnp.ones((8 * 512,)),),
    ),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_lowers_for_cuda_with_the_kernel_and_for_cpu_without(name):
    f, args = OPS[name]
    cuda = _lowered_for(f, args(), "cuda")
    assert "triton" in cuda  # the Pallas kernel, as a Triton custom call
    cpu = _lowered_for(f, args(), "cpu")
    assert "triton" not in cpu  # the plain-JAX reference


def test_engine_step_lowers_for_cuda(mesh24):
    """The whole sharded layer (gather, hpZ, qgZ) with its kernels lowers for CUDA."""
    from jax.sharding import PartitionSpec as P

    from zpp_jax import AXES, ShardedLayer, ZeroPPConfig, shard_params, shard_spec
    from zpp_jax.models.blocks import block, init_block

    params = init_block(jax.random.key(0), 16, 32)
    shards, layout = shard_params(params, mesh24)
    layer = ShardedLayer(block, layout, ZeroPPConfig(error_feedback=True))

    def local(shard, x, residual):
        def loss(shard, residual):
            return jnp.sum(layer(shard, x, residual))

        return jax.grad(loss, argnums=(0, 1))(shard, residual)

    f = jax.shard_map(
        local,
        mesh=mesh24,
        in_specs=(shard_spec(), P(AXES), shard_spec()),
        out_specs=(shard_spec(), shard_spec()),
        check_vma=False,
    )
    residual = layer.init_residuals(mesh24)
    text = _lowered_for(f, (shards, jnp.ones((8, 4, 16)), residual), "cuda")
    assert text.count("triton") >= 4
