"""The Pallas kernels against the plain-JAX reference: bit for bit in
interpret mode, and lowering for CUDA from this CPU-only machine."""

import contextlib
import functools
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SETTINGS = settings(max_examples=6, deadline=None)
# The plain-JAX reference, jitted: one compilation per shape, not per operation.
ref_quantize = jax.jit(pk.reference.quantize, static_argnums=(1, 2, 3))
ref_dequantize = jax.jit(pk.reference.dequantize, static_argnums=(1, 2, 3))
ref_dsq = jax.jit(pk.reference.dequantize_sum_quantize, static_argnums=(1, 2, 4))


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
    x = (3 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)
    flat = x.reshape(-1)
    if specials and flat.size > 8:
        rng = np.random.default_rng(seed)
        zero_at = rng.integers(0, flat.size - 4)
        flat[zero_at : zero_at + min(300, flat.size - zero_at)] = 0  # an all-zero block
        flat[rng.integers(0, flat.size)] = rng.choice([np.nan, np.inf, -np.inf])
    return jnp.asarray(x).astype(dtype)


blocks = st.sampled_from([2, 6, 64, 100, 256])
sizes = st.integers(1, 1500)
roundings = st.sampled_from(pk.ROUNDINGS)


@pytest.mark.slow
@SETTINGS
@given(
    n=sizes,
    lead=st.integers(1, 3),
    block=blocks,
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from(DTYPES),
    specials=st.booleans(),
    seed=st.integers(0, 999),
    rounding=roundings,
)
def test_quantize_and_dequantize_bitwise(n, lead, block, bits, dtype, specials, seed, rounding):
    x = _data(seed, (lead, n), dtype, specials)
    q = pk.quantize(x, bits, block, rounding=rounding, interpret=True)
    _same(q, ref_quantize(x, bits, block, rounding))
    out = DTYPES[seed % 3]
    _same(pk.dequantize(q, bits, n, out, interpret=True), ref_dequantize(q, bits, n, out))


@pytest.mark.slow
@SETTINGS
@given(
    k=st.integers(1, 4),
    size=sizes,
    block=blocks,
    bits=st.sampled_from([4, 8]),
    with_residual=st.booleans(),
    specials=st.booleans(),
    seed=st.integers(0, 999),
    rounding=roundings,
)
def test_dequantize_sum_quantize_bitwise(
    k, size, block, bits, with_residual, specials, seed, rounding
):
    q = ref_quantize(_data(seed, (k, 2, size), jnp.float32, specials), bits, block, "nearest")
    residual = _data(seed + 1, (2, size), jnp.float32, False) * 0.1 if with_residual else None
    ref = ref_dsq(q, bits, size, residual, rounding)
    got = pk.dequantize_sum_quantize(q, bits, size, residual, rounding=rounding, interpret=True)
    _same(got, ref)
    # and the reference is what its docstring says
    total = sum(
        np.asarray(ref_dequantize(pk.QuantizedBlocks(q.codes[j], q.scales[j]), bits, size))
        for j in range(k)
    )
    eb = q.codes.shape[-1] * (2 if bits == 4 else 1)
    if residual is not None:
        total = total + np.asarray(residual)
    _same(ref[0], ref_quantize(jnp.asarray(total), bits, eb, rounding))
    if residual is not None:  # the new residual is what the requantization lost
        lost = total - np.asarray(ref_dequantize(ref[0], bits, size))
        np.testing.assert_array_equal(np.asarray(ref[1]), lost)


@pytest.mark.slow
@SETTINGS
@given(
    shape=st.sampled_from([(1, 8), (2, 4), (4, 2), (8, 1), (2, 2)]),
    s=st.integers(1, 700),
    block=blocks,
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 999),
    rounding=roundings,
)
def test_quantize_reordered_bitwise(shape, s, block, bits, dtype, seed, rounding):
    nodes, local = shape
    full = _data(seed, (nodes * local * s,), dtype, True)
    q = pk.quantize_reordered(full, nodes, local, bits, block, rounding=rounding, interpret=True)
    rows = full.reshape(nodes, local, s).swapaxes(0, 1)
    _same(q, ref_quantize(rows, bits, block, rounding))
    assert q.codes.shape[:2] == (local, nodes)
    residual = _data(seed + 1, (local, nodes, s), jnp.float32, False) / 10
    _feedback_case(full, residual, nodes, local, bits, block, rounding)


def _feedback_case(full, residual, nodes, local, bits, block, rounding):
    """The fused error-feedback quantization against the reference, and the
    reference against its definition: the blocks of the sum, and the new
    residual is exactly what they lost."""
    got = pk.quantize_reordered_with_feedback(
        full, residual, nodes, local, bits, block, rounding=rounding, interpret=True
    )
    s = full.shape[0] // (nodes * local)
    ref = pk.reference.quantize_reordered_with_feedback(
        full, residual, nodes, local, bits, block, rounding
    )
    _same(got, ref)
    total = np.asarray(full.reshape(nodes, local, s).swapaxes(0, 1), np.float32) + np.asarray(
        residual
    )
    _same(ref[0], ref_quantize(jnp.asarray(total), bits, block, rounding))
    lost = total - np.asarray(ref_dequantize(ref[0], bits, s))
    np.testing.assert_array_equal(np.asarray(ref[1]), lost)
    assert ref[1].shape == (local, nodes, s) and ref[1].dtype == jnp.float32


def test_quantize_reordered_with_feedback_checks_its_input():
    full = jnp.ones((8 * 64,))
    with pytest.raises(ValueError, match=r"residual has shape \(2, 4, 64\), expected \(4, 2, 64\)"):
        pk.quantize_reordered_with_feedback(full, jnp.zeros((2, 4, 64)), 2, 4, 4, 64)
    with pytest.raises(ValueError, match="multiple of 8, got shape"):
        pk.quantize_reordered_with_feedback(jnp.ones((100,)), jnp.zeros((4, 2, 12)), 2, 4, 4, 64)


@pytest.mark.parametrize(
    "shape, dtype, bits, block, rounding",
    [
        ((2, 1000), jnp.bfloat16, 4, 100, "nearest"),
        ((777,), jnp.float16, 8, 64, "nearest"),
        pytest.param((3, 5), jnp.float32, 4, 256, "nearest", marks=pytest.mark.slow),
        pytest.param((2, 1000), jnp.float32, 4, 64, "stochastic", marks=pytest.mark.slow),
        pytest.param((777,), jnp.bfloat16, 8, 100, "stochastic", marks=pytest.mark.slow),
    ],
)
def test_fixed_cases_bitwise(shape, dtype, bits, block, rounding):
    """A few hand-picked cases of every op (odd sizes, a block that is not a
    power of two, a row shorter than a block, zero and non-finite blocks);
    the hypothesis tests above search many more."""
    x = _data(3, shape, dtype, specials=True)
    n = shape[-1]
    q = pk.quantize(x, bits, block, rounding=rounding, interpret=True)
    _same(q, ref_quantize(x, bits, block, rounding))
    _same(pk.dequantize(q, bits, n, dtype, interpret=True), ref_dequantize(q, bits, n, dtype))
    stacked = ref_quantize(_data(4, (3, *shape), jnp.float32, True), bits, block, "nearest")
    residual = _data(5, shape, jnp.float32, False)
    _same(
        pk.dequantize_sum_quantize(stacked, bits, n, residual, rounding=rounding, interpret=True),
        ref_dsq(stacked, bits, n, residual, rounding),
    )
    full = _data(6, (8 * n,), dtype, True)
    _same(
        pk.quantize_reordered(full, 2, 4, bits, block, rounding=rounding, interpret=True),
        ref_quantize(full.reshape(2, 4, n).swapaxes(0, 1), bits, block, rounding),
    )
    residual = _data(7, (4, 2, n), jnp.float32, False) / 10
    _feedback_case(full, residual, 2, 4, bits, block, rounding)


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased_within_one_step(bits):
    """Stochastic codes are x/scale rounded down or up: the error of every
    element is under one step, and its mean is zero (nearest rounding of
    values just above a half step, for contrast, is biased by 0.4 steps).
    The dither is a hash of each value and its position in its block, so
    only elements equal in both round alike."""
    rng = np.random.default_rng(0)
    block = 64
    x = rng.standard_normal((2048, block)).astype(np.float32)
    x[:, 0] = 8.0  # every block has the same scale, 8 / qmax rounded up
    q = ref_quantize(jnp.asarray(x), bits, block, "stochastic")
    step = np.asarray(q.scales).reshape(-1, 1)  # one block per row
    err = (np.asarray(ref_dequantize(q, bits, block)) - x) / step
    assert np.all(np.abs(err) < 1)
    assert abs(err.mean()) < 0.005  # 4 standard errors of 2**17 draws of spread <= 0.5
    # Values of 0.55 to 0.65 steps: nearest rounds every one up to a whole
    # step, stochastic to 0 or 1 step with a mean of about 0.6.
    frac = rng.uniform(0.55, 0.65, (512, block)).astype(np.float32)
    small = frac * float(step[0, 0])
    small[:, 0] = 8.0
    means = {}
    for rounding in pk.ROUNDINGS:
        got = ref_dequantize(ref_quantize(jnp.asarray(small), bits, block, rounding), bits, block)
        means[rounding] = float(np.mean((np.asarray(got) - small)[:, 1:]) / step[0, 0])
    assert means["nearest"] == pytest.approx(1 - frac[:, 1:].mean(), abs=0.001)
    assert abs(means["stochastic"]) < 0.01  # 4 standard errors of 32256 draws


def test_rounding_must_be_known():
    with pytest.raises(ValueError, match="rounding='up' is not supported"):
        pk.quantize(jnp.ones(8), 8, 8, rounding="up")


def test_aligned_multi_tile_sizes():
    # Sizes that are multiples of the tile (no padding path) and several tiles long.
    x = _data(7, (3, 256 * 96), jnp.bfloat16, True)
    for bits in (4, 8):
        q = pk.quantize(x, bits, 256, interpret=True)
        _same(q, ref_quantize(x, bits, 256))
        _same(
            pk.dequantize(q, bits, x.shape[-1], jnp.bfloat16, interpret=True),
            ref_dequantize(q, bits, x.shape[-1], jnp.bfloat16),
        )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [64, 100])  # a power of two, and one padded to 128
def test_dequantize_runs_are_the_slices_of_dequantize_bitwise(bits, block):
    """Runs of 3, 1, 4 and 8 blocks (tiles of one block, none straddling two
    runs), and of 8, 16 and 4 (tiles of 4), over two leading rows, with an
    all-zero block and a non-finite value: each equals its slice of
    `dequantize`."""
    for runs in [(3, 1, 4, 8), (8, 16, 4)]:
        _same_as_slices(runs, bits, block)


def _same_as_slices(runs, bits, block):
    x = _data(3, (2, sum(runs) * block), jnp.float32, True)
    q = ref_quantize(x, bits, block)
    whole = ref_dequantize(q, bits, x.shape[-1], jnp.bfloat16)
    got = pk.dequantize_runs(q, bits, runs, jnp.bfloat16, interpret=True)
    ref = pk.reference.dequantize_runs(q, bits, runs, jnp.bfloat16)
    starts = np.cumsum((0, *runs)) * block
    want = [whole[:, a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    _same(got, tuple(want))
    _same(ref, tuple(want))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [64, 100])
def test_dequantize_runs_read_a_wire_of_bytes_in_either_row_order(bits, block):
    """Codes given as rows of bytes (a gathered wire: the blocks, then 13
    other bytes), over leading axes (3, 2) read as (2, 3): the same bits as
    the blocks themselves, rows swapped."""
    runs = (4, 2, 8)
    x = _data(5, (3, 2, sum(runs) * block), jnp.float32, True)
    q = ref_quantize(x, bits, block)
    flat = q.codes.reshape(3, 2, -1)
    if flat.dtype != jnp.uint8:
        flat = jax.lax.bitcast_convert_type(flat, jnp.uint8)
    wire = pk.QuantizedBlocks(jnp.pad(flat, ((0, 0), (0, 0), (0, 13))), q.scales)
    swapped = pk.QuantizedBlocks(jnp.swapaxes(q.codes, 0, 1), jnp.swapaxes(q.scales, 0, 1))
    want = pk.reference.dequantize_runs(swapped, bits, runs, jnp.bfloat16)
    for run in (pk.dequantize_runs, pk.reference.dequantize_runs):
        kw = {"interpret": True} if run is pk.dequantize_runs else {}
        got = run(wire, bits, runs, jnp.bfloat16, block=block, swap_lead=True, **kw)
        assert [a.shape for a in got] == [(2, 3, n * block) for n in runs]
        _same(got, want)


def test_dequantize_runs_must_cover_the_blocks():
    q = ref_quantize(jnp.ones((4 * 64,)), 8, 64)
    for runs in [(1, 2), (4, 0), (5,)]:
        with pytest.raises(ValueError, match="summing to the 4 blocks of q"):
            pk.dequantize_runs(q, 8, runs)


# The GPU the kernels are lowered for: an H200 (sm_90). Triton lowers for
# a compute capability, which JAX reads from the current abstract mesh's
# device when no GPU is attached (jax 0.11 and later).
H200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")


def _on_h200():
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200))


def _lowered_for(f, args, platform):
    """`f`'s StableHLO for `platform`: the kernels' for an H200 on "cuda"."""
    with _on_h200() if platform == "cuda" else contextlib.nullcontext():
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_the_target_is_sm_90():
    from jax.experimental.pallas import triton as plgpu

    with _on_h200():
        assert plgpu.get_gpu_info().compute_capability == 90


_TRITON_CALL = re.compile(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)"')
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(", re.M)
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")


def triton_kernels(text: str) -> Counter:
    """How many times each Pallas Triton kernel runs in a lowered StableHLO
    module: its calls in every function, times the calls of that function
    (a jitted op used twice is one function called twice)."""
    starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(text)]
    bodies = {
        name: text[start : starts[i + 1][0] if i + 1 < len(starts) else len(text)]
        for i, (start, name) in enumerate(starts)
    }

    def runs(name):
        body = bodies[name]
        total = Counter(m.group(1) for m in _TRITON_CALL.finditer(body))
        for callee in _CALL.findall(body):
            total += runs(callee)
        return total

    return runs("main")


QUANTIZE, DEQUANTIZE, DSQ = "_quantize_kernel", "_dequantize_kernel", "_dsq_kernel"
OPS = {
    "quantize8": (
        lambda x: pk.quantize(x, 8, 256),
        lambda: (jnp.ones((4, 1000), jnp.bfloat16),),
        QUANTIZE,
    ),
    "quantize4": (
        lambda x: pk.quantize(x, 4, 64),
        lambda: (jnp.ones((1000,), jnp.float16),),
        QUANTIZE,
    ),
    "dequantize4": (
        lambda q: pk.dequantize(q, 4, 1000, jnp.bfloat16),
        lambda: (ref_quantize(jnp.ones((4, 1000)), 4, 64),),
        DEQUANTIZE,
    ),
    "dequantize8": (
        lambda q: pk.dequantize(q, 8, 1000),
        lambda: (ref_quantize(jnp.ones(1000), 8, 256),),
        DEQUANTIZE,
    ),
    "dequantize_sum_quantize": (
        lambda q, r: pk.dequantize_sum_quantize(q, 4, 512, r),
        lambda: (ref_quantize(jnp.ones((4, 2, 512)), 4, 64), jnp.zeros((2, 512))),
        DSQ,
    ),
    "quantize_reordered": (
        lambda x: pk.quantize_reordered(x, 2, 4, 4, 64),
        lambda: (jnp.ones((8 * 512,)),),
        QUANTIZE,
    ),
    # the gradient defaults: stochastic rounding, scales exact in bf16
    "quantize_reordered stochastic": (
        lambda x: pk.quantize_reordered(
            x, 2, 4, 4, 32, rounding="stochastic", scale_dtype="bfloat16"
        ),
        lambda: (jnp.ones((8 * 512,)),),
        QUANTIZE,
    ),
    "quantize_reordered_with_feedback": (
        lambda x, r: pk.quantize_reordered_with_feedback(
            x, r, 2, 4, 4, 32, rounding="stochastic", scale_dtype="bfloat16"
        ),
        lambda: (jnp.ones((8 * 512,)), jnp.zeros((4, 2, 512))),
        QUANTIZE,
    ),
    "dequantize_sum_quantize stochastic": (
        lambda q, r: pk.dequantize_sum_quantize(
            q, 4, 512, r, rounding="stochastic", scale_dtype="bfloat16"
        ),
        lambda: (ref_quantize(jnp.ones((4, 2, 512)), 4, 32), jnp.zeros((2, 512))),
        DSQ,
    ),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_lowers_for_cuda_with_the_kernel_and_for_cpu_without(name):
    f, args, kernel = OPS[name]
    # One Triton call, of this op's own kernel, and nothing else of Pallas.
    assert triton_kernels(_lowered_for(f, args(), "cuda")) == Counter({kernel: 1})
    cpu = _lowered_for(f, args(), "cpu")
    assert "triton" not in cpu and "custom_call" not in cpu  # the plain-JAX reference


def test_dequantize_runs_lowers_to_one_kernel_and_no_slice():
    """On a GPU one kernel reads the codes once and writes each run to its
    own output: no slice copies a run out of a whole, nothing is padded."""
    q = ref_quantize(jnp.ones((8, 9 * 256)), 8, 256)
    cuda = _lowered_for(lambda q: pk.dequantize_runs(q, 8, (4, 2, 3), jnp.bfloat16), (q,), "cuda")
    assert triton_kernels(cuda) == Counter({"_dequantize_runs_kernel": 1})
    assert "stablehlo.slice" not in cuda and "stablehlo.pad" not in cuda
    # The same from rows of bytes gathered in the other order: read in place.
    wire = pk.QuantizedBlocks(jnp.zeros((4, 2, 9 * 256 + 40), jnp.uint8), jnp.ones((4, 2, 9)))
    cuda = _lowered_for(
        lambda q: pk.dequantize_runs(q, 8, (4, 2, 3), jnp.bfloat16, block=256, swap_lead=True),
        (wire,),
        "cuda",
    )
    assert triton_kernels(cuda) == Counter({"_dequantize_runs_kernel": 1})
    for op in ("slice", "pad", "transpose", "concatenate"):
        assert f"stablehlo.{op}" not in cuda, op


def test_a_block_count_the_tile_does_not_divide_is_not_padded():
    """100 blocks of 256 in tiles of 32: the kernels read and write the
    arrays as they are (Triton masks the last tile), nothing is copied
    into a padded one or sliced out of it."""
    x = jnp.ones((2, 100 * 256), jnp.float32)
    q = ref_quantize(x, 8, 256)
    for f, args in [
        (lambda x: pk.quantize(x, 8, 256), (x,)),
        (lambda q: pk.dequantize(q, 8, 100 * 256, jnp.bfloat16), (q,)),
        (lambda x: pk.quantize_reordered(x.reshape(-1), 2, 1, 8, 256), (x,)),
    ]:
        cuda = _lowered_for(f, args, "cuda")
        assert "stablehlo.pad" not in cuda and "stablehlo.slice" not in cuda


def test_a_layers_gathered_weights_decode_in_one_kernel_reading_the_wire_in_place():
    """`WeightWire.decode` of a layer whose two kernels are whole 256-blocks
    per device and whose bias is not, from rows gathered (local, nodes):
    one kernel decodes both kernels from the wire where it lies, one the
    short bias; no slice, transpose or concatenation copies the codes."""
    from zpp_jax import ZeroPPConfig
    from zpp_jax.partition import call_layout
    from zpp_jax.wire import WeightWire

    config = ZeroPPConfig()
    params = [((256, 512), jnp.float32, 0), ((512, 256), jnp.float32, 0), ((512,), jnp.float32, 0)]
    wire = WeightWire(call_layout(config, params, 8), config, jnp.bfloat16)
    sent = jax.eval_shape(wire.encode, jax.ShapeDtypeStruct((wire.layout.shard_size,), jnp.float32))
    rows = jax.ShapeDtypeStruct((4, 2, *sent.shape), sent.dtype)
    cuda = _lowered_for(lambda r: wire.decode(r, swapped=True), (rows,), "cuda")
    assert triton_kernels(cuda) == Counter({"_dequantize_runs_kernel": 1, DEQUANTIZE: 1})
    copying = r"stablehlo\.(?:slice|transpose|concatenate).*-> tensor<([\dx]+)x"
    copied = [math.prod(int(d) for d in m.group(1).split("x")) for m in re.finditer(copying, cuda)]
    assert max(copied, default=0) < sent.shape[0] * 8 / 20  # the scales and the bias alone


def test_over_a_cpu_mesh_only_the_reference_is_traced(mesh24):
    """Over a mesh of CPU devices the choice is made when tracing: no
    platform switch and no kernel in the program, and the same codes as the
    reference. Without a mesh both are traced and the switch waits for
    lowering; `interpret` still runs the kernel."""
    from jax.sharding import PartitionSpec as P

    x = jax.random.normal(jax.random.key(0), (8, 1000))

    def over_mesh(op):
        return jax.shard_map(
            op, mesh=mesh24, in_specs=P("node"), out_specs=P("node"), check_vma=False
        )

    def codes(x, interpret=False):
        return pk.quantize(x, 4, 64, interpret=interpret).codes

    def program(f):
        return str(jax.make_jaxpr(f)(x))

    for mark in ("platform_index", "cond[", "pallas_call"):
        assert mark in program(codes)
        assert mark not in program(over_mesh(codes))
    assert "pallas_call" in program(over_mesh(functools.partial(codes, interpret=True)))
    np.testing.assert_array_equal(jax.jit(over_mesh(codes))(x), ref_quantize(x, 4, 64).codes)


def test_engine_step_lowers_for_cuda(mesh24):
    """A whole sharded layer's gradient (qwZ, hpZ, qgZ with error feedback)
    lowers for CUDA with exactly the kernels the algorithm calls. The
    shard_map runs over a mesh of the same shape whose devices are H200s:
    each equation lowers for the device of the mesh it was traced on."""
    from jax.sharding import AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from zpp_jax import ZeroPPConfig
    from zpp_jax.lowlevel import AXES, ShardedLayer, primary_spec, to_primary_shards
    from zpp_jax.models.blocks import block, init_block

    params = init_block(jax.random.key(0), 16, 32)
    shards, layout = to_primary_shards(params, mesh24)
    layer = ShardedLayer(block, layout, ZeroPPConfig(error_feedback=True))
    gpus = AbstractMesh(mesh24.axis_sizes, mesh24.axis_names, abstract_device=H200)

    def local(shard, x, residual):
        def loss(shard, residual):
            return jnp.sum(jnp.square(layer(shard, x, residual)))  # needs the forward

        return jax.grad(loss, argnums=(0, 1))(shard, residual)

    f = jax.shard_map(
        local,
        mesh=gpus,
        in_specs=(primary_spec(), P(AXES), primary_spec()),
        out_specs=(primary_spec(), primary_spec()),
        check_vma=False,
    )

    def on_gpus(tree, spec):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(gpus, spec)),
            tree,
        )

    args = (shards, jnp.ones((8, 4, 16)), layer.init_residuals(mesh24))
    specs = (primary_spec(), P(AXES), primary_spec())
    text = _lowered_for(f, tuple(map(on_gpus, args, specs)), "cuda")
    assert triton_kernels(text) == Counter(
        {
            # forward: quantize this device's shard (qwZ); dequantize the
            # gathered codes. Gradient with error feedback: quantize the
            # reordered gradient plus residual, the new residual in the same
            # pass.
            QUANTIZE: 2,
            # forward weight, backward weight (hpZ re-gather) and the final
            # cross-node sum
            DEQUANTIZE: 3,
            # the intra-node partial sums, requantized for the node all-to-all
            DSQ: 1,
        }
    )
