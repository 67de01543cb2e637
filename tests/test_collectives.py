import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import quant_steps, two_rounding_bound
from jax import lax
from jax.sharding import PartitionSpec as P

from zpp_jax import collectives, make_mesh, quant
from zpp_jax.analysis import collectives_in_hlo
from zpp_jax.lowlevel import AXES, NODE, mesh_shape


def _smap(mesh, f, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


@pytest.mark.parametrize("s", [1, 5, 300])
def test_all_gather_exact(mesh, s):
    n = mesh.devices.size
    x = jax.random.normal(jax.random.key(s), (n * s,))
    f = _smap(mesh, lambda sh: collectives.all_gather(sh)[None], P(AXES), P(AXES))
    out = np.asarray(f(x)).reshape(n, n * s)
    for row in out:
        np.testing.assert_array_equal(row, np.asarray(x))
    g = _smap(mesh, lambda sh: collectives.all_gather(sh, jnp.bfloat16)[None], P(AXES), P(AXES))
    np.testing.assert_array_equal(
        np.asarray(g(x)).reshape(n, -1)[3], np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
    )


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("s", [3, 257])
def test_quantized_all_gather_within_half_step(mesh, bits, s):
    n = mesh.devices.size
    x = 5 * jax.random.normal(jax.random.key(s), (n * s,))
    f = _smap(
        mesh, lambda sh: collectives.quantized_all_gather(sh, bits, 64)[None], P(AXES), P(AXES)
    )
    out = np.asarray(f(x)).reshape(n, n * s)
    step = quant_steps(np.asarray(x).reshape(n, s), bits, 64).reshape(-1)
    for row in out:  # every device sees the same weights
        np.testing.assert_array_equal(row, out[0])
    assert np.all(np.abs(out[0] - np.asarray(x)) <= 0.5 * step * (1 + 1e-5))


def _per_device_full(mesh, s, seed=0, scale_by_device=True):
    n = mesh.devices.size
    g = jax.random.normal(jax.random.key(seed), (n, n * s))
    if scale_by_device:  # different magnitudes per device and per chunk
        g = g * (1 + jnp.arange(n))[:, None] * jnp.repeat(1 + jnp.arange(n) % 3, s)[None]
    return g


def test_reduce_scatter_is_the_mean(mesh):
    s = 37
    g = _per_device_full(mesh, s)
    f = _smap(mesh, lambda full: collectives.reduce_scatter(full[0]), P(AXES, None), P(AXES))
    np.testing.assert_allclose(np.asarray(f(g)), np.asarray(g).mean(0), rtol=1e-6, atol=1e-6)


def _hier(mesh, bits, block, residual=False):
    def f(full, res):
        out, new = collectives.hierarchical_reduce_scatter(
            full[0], bits, block, res[0] if residual else None
        )
        return out, (new[None] if residual else res)

    return _smap(mesh, f, (P(AXES, None), P(AXES, None)), (P(AXES), P(AXES, None)))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("s, block", [(300, 64), (37, 16), (1, 256)])
def test_hierarchical_within_two_roundings(mesh, bits, s, block):
    nodes, local = mesh_shape(mesh)
    g = _per_device_full(mesh, s)
    out, _ = _hier(mesh, bits, block)(g, jnp.zeros((g.shape[0], 1)))
    exact = np.asarray(g, np.float64).mean(0)
    bound = two_rounding_bound(np.asarray(g), nodes, local, bits, block)
    err = np.abs(np.asarray(out) - exact)
    assert np.all(err <= bound * (1 + 1e-4) + 1e-6), float(np.max(err - bound))
    if s > 1:  # (a one-element chunk is its own block: nearly exact)
        # ... and the bound is not vacuous: the error is a sizeable part of it
        assert err.max() > 0.05 * bound.max()


def test_hierarchical_zero_gradient_stays_zero(mesh):
    g = jnp.zeros((mesh.devices.size, mesh.devices.size * 64))
    out, _ = _hier(mesh, 4, 32)(g, jnp.zeros((g.shape[0], 1)))
    assert np.all(np.asarray(out) == 0)


def test_hierarchical_nan_propagates(mesh):
    g = _per_device_full(mesh, 16).at[3, 5].set(jnp.nan)
    out = np.asarray(_hier(mesh, 4, 32)(g, jnp.zeros((g.shape[0], 1)))[0])
    assert np.isnan(out[5])


def test_hierarchical_skips_size_one_axes():
    # 1 x 8: a single quantized all-to-all; 8 x 1: a single one over nodes.
    for shape in [(1, 8), (8, 1)]:
        mesh = make_mesh(*shape)
        g = _per_device_full(mesh, 40)
        out, _ = _hier(mesh, 8, 32)(g, jnp.zeros((8, 1)))
        rows = np.asarray(g).reshape(8, 8, 40)
        step = quant_steps(rows, 8, 32)
        bound = 0.5 * step.sum(0).reshape(-1) / 8
        assert np.all(np.abs(np.asarray(out) - np.asarray(g).mean(0)) <= bound * (1 + 1e-4) + 1e-7)


def test_error_feedback_makes_the_mean_converge(mesh):
    """The same gradient T times: without error feedback every call rounds the
    same way, so the mean keeps the one-call error; with it the rounding
    errors telescope, and the mean is within (final residual) / T of exact,
    about twice the one-call bound over T."""
    nodes, local = mesh_shape(mesh)
    n, s, calls = nodes * local, 96, 50
    g = _per_device_full(mesh, s, seed=3)
    exact = np.asarray(g, np.float64).mean(0)
    bound = two_rounding_bound(np.asarray(g), nodes, local, 4, 32)
    size = collectives.residual_size(s, nodes, local)
    errors = {}
    for ef in (False, True):
        f = _hier(mesh, 4, 32, residual=ef)
        res = jnp.zeros((n, size) if ef else (n, 1), jnp.float32)
        total = np.zeros_like(exact)
        for _ in range(calls):
            out, res = f(g, res)
            total += np.asarray(out, np.float64)
        errors[ef] = np.abs(total / calls - exact)
    assert np.all(errors[True] <= 2 * bound / calls + 1e-6)
    assert np.max(errors[False]) > 2 * np.max(bound) / calls  # ... which plain rounding is not


def test_int4_travels_two_codes_per_byte(mesh24):
    nodes, local, s, block = 2, 4, 1024, 256
    n = nodes * local
    f = _hier(mesh24, 4, block)
    hlo = f.lower(jnp.ones((n, n * s)), jnp.zeros((n, 1))).compile().as_text()
    cs = collectives_in_hlo(hlo)
    # Inside the node, one all-to-all of bytes: each peer's codes (two per
    # byte) followed by its fp32 scales. Across nodes, one permute per peer
    # node, carrying that node's chunk the same way.
    (intra,) = [c for c in cs if c.kind == "all-to-all"]
    inter = [c for c in cs if c.kind == "collective-permute"]
    assert not intra.spans_nodes(local) and intra.dtypes == ("u8",) * local
    assert len(inter) == nodes - 1 and all(c.spans_nodes(local) for c in inter)
    # codes: half a byte per element; scales: 4 bytes per block
    assert intra.result_bytes == 4 * (n * s // block) + n * s // 2
    assert all(c.dtypes == ("u8",) and c.result_bytes == 4 * (s // block) + s // 2 for c in inter)
    fp32_bytes = n * s * 4
    inter_bytes = sum(c.moved_bytes for c in inter)
    # 1/(8 * local) of the fp32 vector per node; scales: 4 bytes per 128 code bytes
    assert inter_bytes * 8 * local * nodes <= fp32_bytes * 1.04


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_the_step_across_nodes_sends_each_peer_node_its_chunk(shape):
    """The exchange over `node` (collective-permutes) returns what an
    all-to-all returns, row j from node j, on 2 and on 4 nodes."""
    mesh = make_mesh(*shape)
    nodes = shape[0]
    x = jnp.arange(8 * nodes * 3, dtype=jnp.float32).reshape(8, nodes, 3)

    def body(fn):
        return _smap(mesh, lambda a: fn(a[0])[None], P(AXES), P(AXES))

    def all_to_all(a):
        return lax.all_to_all(a, NODE, 0, 0, tiled=True)

    got = body(lambda a: collectives._permute_rows(a, NODE))(x)
    want = body(all_to_all)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bf16_scales_travel_in_two_bytes(mesh24):
    """With scale_dtype="bfloat16" the scales cross in 2 bytes a block (after
    the codes, in the same message), and the result stays within the
    reduction's error bound."""
    nodes, local, s, block = 2, 4, 1024, 32

    def body(full):
        out, _ = collectives.hierarchical_reduce_scatter(full[0], 4, block, scale_dtype="bfloat16")
        return out

    f = _smap(mesh24, body, P(AXES, None), P(AXES))
    g = _per_device_full(mesh24, s)
    hlo = f.lower(g).compile().as_text()
    (inter,) = [c for c in collectives_in_hlo(hlo) if c.kind == "collective-permute"]
    assert inter.spans_nodes(local) and inter.dtypes == ("u8",)
    assert inter.result_bytes == 2 * (s // block) + s // 2  # the peer node's chunk
    out = np.asarray(f(g), np.float64)
    exact = np.asarray(g, np.float64).mean(0)
    bound = two_rounding_bound(np.asarray(g), nodes, local, 4, block, scale_dtype="bfloat16")
    assert np.all(np.abs(out - exact) <= bound * (1 + 1e-5) + 1e-12)


def test_bf16_wire_is_16_bit_and_accumulates_in_fp32(mesh24):
    n, s = 8, 64
    g = _per_device_full(mesh24, s)
    f = _smap(
        mesh24,
        lambda full: collectives.reduce_scatter(full[0], jnp.bfloat16),
        P(AXES, None),
        P(AXES),
    )
    expect = np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32)).sum(0) / n
    np.testing.assert_allclose(np.asarray(f(g)), expect, rtol=1e-6)
    hlo = f.lower(g).compile().as_text()
    (c,) = collectives_in_hlo(hlo)
    assert c.kind == "all-to-all" and set(c.dtypes) == {"u16"} and c.result_bytes == n * s * 2
    gather = _smap(
        mesh24, lambda sh: collectives.all_gather(sh, jnp.bfloat16)[None], P(AXES), P(AXES)
    )
    (c,) = collectives_in_hlo(gather.lower(jnp.ones(n * s)).compile().as_text())
    assert c.kind == "all-gather" and c.dtypes == ("u16",) and c.result_bytes == n * s * 2


@pytest.mark.parametrize("shape", [(2, 4), (1, 8), (8, 1)])
@pytest.mark.parametrize("bits", [4, 8])
def test_hierarchical_from_quantized_blocks_is_bit_identical(shape, bits):
    mesh, block = make_mesh(*shape), 32
    g = _per_device_full(mesh, 96)

    def f(full):
        blocks = quant.quantize(full[0], bits, block)
        return collectives.hierarchical_reduce_scatter(blocks, bits, block)[0]

    from_blocks = _smap(mesh, f, P(AXES, None), P(AXES))(g)
    from_fp32 = _hier(mesh, bits, block)(g, jnp.zeros((8, 1)))[0]
    np.testing.assert_array_equal(np.asarray(from_blocks), np.asarray(from_fp32))


def test_hierarchical_rejects_bad_quantized_blocks(mesh24):
    def call(codes_shape, nb, residual=None):
        blocks = quant.QuantizedBlocks(jnp.zeros(codes_shape, jnp.uint8), jnp.zeros(nb))
        f = _smap(
            mesh24,
            lambda r: collectives.hierarchical_reduce_scatter(
                blocks, 4, 32, None if residual is None else r
            )[0],
            P(),
            P(AXES),
        )
        return f(jnp.zeros(collectives.residual_size(32, 2, 4)))

    with pytest.raises(ValueError, match="N = 8 devices"):
        call((12, 16), 12)
    with pytest.raises(ValueError, match=r"expected \(16, 16\)"):
        call((16, 32), 16)
    with pytest.raises(ValueError, match="error feedback needs the fp32 gradient"):
        call((16, 16), 16, residual=True)
