import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zpp_jax import quant
from zpp_jax.lowlevel import FlatLayout, from_primary_shards, to_primary_shards


def _tree():
    return {
        "scalar": jnp.float32(3.5),
        "bias": jnp.arange(7, dtype=jnp.bfloat16),
        "w": jax.random.normal(jax.random.key(0), (13, 11)).astype(jnp.float16),
        "prime": jnp.linspace(-1, 1, 101),
    }


def test_roundtrip_keeps_values_and_dtypes(mesh):
    tree = _tree()
    shards, layout = to_primary_shards(tree, mesh)
    n = mesh.devices.size
    assert layout.size == 1 + 7 + 143 + 101
    assert layout.shard_size == -(-layout.size // n)
    assert shards.shape == (n * layout.shard_size,) and shards.dtype == jnp.float32
    assert {s.data.shape for s in shards.addressable_shards} == {(layout.shard_size,)}
    back = from_primary_shards(shards, layout)
    for k in tree:
        assert back[k].dtype == tree[k].dtype and back[k].shape == tree[k].shape
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
    # padding is zero
    assert np.all(np.asarray(shards)[layout.size :] == 0)


def test_stacked(mesh24):
    stack = {"a": jnp.arange(3 * 5, dtype=jnp.float32).reshape(3, 5), "b": jnp.ones((3, 2, 2))}
    shards, layout = to_primary_shards(stack, mesh24, stacked=True)
    assert shards.shape == (3, 8 * layout.shard_size)
    assert layout.shapes == ((5,), (2, 2))
    back = from_primary_shards(shards, layout, stacked=True)
    np.testing.assert_array_equal(np.asarray(back["a"]), np.asarray(stack["a"]))


def test_non_float_is_rejected():
    with pytest.raises(ValueError, match=r"\['step'\] has dtype int32"):
        FlatLayout.from_tree({"w": jnp.ones(3), "step": jnp.int32(0)}, 8)


def test_stacked_layer_counts_must_agree():
    with pytest.raises(ValueError, match="disagree on the number of layers"):
        FlatLayout.from_tree({"a": jnp.ones((2, 3)), "b": jnp.ones((3, 3))}, 8, stacked=True)


def test_empty():
    with pytest.raises(ValueError, match="empty"):
        FlatLayout.from_tree({}, 8)


def test_alignment_keeps_blocks_inside_one_tensor(mesh24):
    tree = {"a": jnp.ones(5), "b": jnp.full((3, 7), 2.0), "c": jnp.full((300,), 3.0)}
    shards, layout = to_primary_shards(tree, mesh24, align=64)
    assert layout.offsets == (0, 64, 128) and layout.size == 428
    assert layout.shard_size % 64 == 0 and layout.shard_size * 8 >= 428
    flat = np.asarray(shards)
    for block in flat.reshape(-1, 64):  # every block holds one tensor's values (or zeros)
        assert len(set(block[block != 0].tolist())) <= 1
    back = from_primary_shards(shards, layout)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
    with pytest.raises(ValueError, match="align must be a positive int"):
        FlatLayout.from_tree(tree, 8, align=0)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gradient_quantized_tensor_by_tensor_equals_flat(bits, rounding):
    """The blocks of the flat fp32 gradient, computed tensor by tensor
    (aligned leaves; gaps and padding as zero blocks), bit for bit."""
    tree = {"a": jnp.arange(-50.0, 50.0).reshape(4, 25) / 7, "b": jnp.full((3,), 7.3), "c": -2.5}
    layout = FlatLayout.from_tree(tree, 8, align=64)
    ref = jax.jit(lambda t: quant.quantize(layout.flatten(t), bits, 32, rounding=rounding))(tree)
    got = jax.jit(lambda t: layout.quantize_gradient(t, bits, 32, rounding, "float32"))(tree)
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(ref.scales))


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [4, 8])
def test_per_parameter_gradient_quantized_by_tensor_equals_flat(bits, rounding, scale_dtype):
    """Per-parameter layout: the blocks of the fp32 rows, computed tensor by
    tensor with the short rows quantized together in one call (gaps and
    padding as zero blocks), bit for bit."""
    from zpp_jax.partition import _SHORT_ROW, ParamLayout

    rng = np.random.default_rng(3)
    shapes = {"w": (16, 512), "b": (8,), "c": (24, 3), "e": (8, 40), "f": (8, 300)}
    dims = {"w": 1, "b": 0, "c": 0, "e": 0, "f": 0}
    tree = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    layout = ParamLayout.from_tree(tree, [dims[k] for k in sorted(dims)], 8, 32, 256)
    rows = {k: layout.slices[i][1] for i, k in enumerate(sorted(shapes))}
    assert rows["w"] > _SHORT_ROW and rows["f"] > _SHORT_ROW  # quantized one by one
    assert max(rows["b"], rows["c"], rows["e"]) <= _SHORT_ROW  # quantized together
    assert layout.shard_size > sum(rows.values())  # with zero gaps

    def ref(t):
        flat = layout.flatten_rows(t).reshape(-1)
        return quant.quantize(flat, bits, 32, rounding=rounding, scale_dtype=scale_dtype)

    want = jax.jit(ref)(tree)
    got = jax.jit(lambda t: layout.quantize_gradient(t, bits, 32, rounding, scale_dtype))(tree)
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
