import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocks import loss_fn, reference_loss_and_grads, sharded_loss_and_grads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax import (
    AXES,
    FlatLayout,
    ShardedLayer,
    ZeroPPConfig,
    make_mesh,
    quant,
    scan_layers,
    shard_params,
    shard_spec,
    unshard_params,
)
from zpp_jax.models.blocks import block, init_stack
from zpp_jax.report import collectives_in_hlo

D, F, LAYERS = 16, 40, 3  # F=40: the flat size is not a multiple of 8 or of the block


def _data(n_dev, dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(1), (n_dev, 6, D)).astype(dtype)
    stack = init_stack(jax.random.key(0), LAYERS, D, F, dtype)
    return stack, x


def _run(mesh, config, stack, x, compute_dtype=None, residuals=None):
    shards, layout = shard_params(stack, mesh, stacked=True)
    f, layer = sharded_loss_and_grads(mesh, config, layout, compute_dtype)
    if config.error_feedback and residuals is None:
        residuals = layer.init_residuals(mesh, LAYERS)
    loss, g, r = f(shards, x, residuals)
    return loss, unshard_params(g, layout, stacked=True), r


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def test_zero3_equals_unsharded_reference(mesh):
    stack, x = _data(mesh.devices.size)
    ref_loss, ref_grads = reference_loss_and_grads(stack, x)
    loss, grads, _ = _run(mesh, ZeroPPConfig.zero3(), stack, x)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), r in zip(leaves, jax.tree.leaves(ref_grads), strict=True):
        assert _max_rel(g, r) <= 1e-5, jax.tree_util.keystr(path)


def test_hpz_equals_zero3(mesh):
    stack, x = _data(mesh.devices.size)
    _, g0, _ = _run(mesh, ZeroPPConfig.zero3(), stack, x)
    _, g1, _ = _run(mesh, ZeroPPConfig.zero3(hpz=True), stack, x)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        assert _max_rel(a, b) <= 1e-6


def _compiled_step_hlo(mesh, config, layers=2):
    stack = jax.eval_shape(lambda: init_stack(jax.random.key(0), layers, D, F))
    layout = FlatLayout.from_tree(stack, mesh.devices.size, stacked=True)
    f, _ = sharded_loss_and_grads(mesh, config, layout)
    shards = jax.ShapeDtypeStruct(
        (layers, layout.padded_size), jnp.float32, sharding=NamedSharding(mesh, shard_spec(True))
    )
    x = jax.ShapeDtypeStruct((8, 6, D), jnp.float32, sharding=NamedSharding(mesh, P(AXES)))
    return f.lower(shards, x, None).compile(), layout


def _forward_hlo(mesh, config, layout, layers=2):
    layer = ShardedLayer(block, layout, config)
    f = jax.shard_map(
        lambda s, x: jax.lax.pmean(loss_fn(scan_layers(layer, s, x)), AXES),
        mesh=mesh,
        in_specs=(shard_spec(True), P(AXES)),
        out_specs=P(),
        check_vma=False,
    )
    return (
        jax.jit(f)
        .lower(jnp.zeros((layers, layout.padded_size)), jnp.zeros((8, 6, D)))
        .compile()
        .as_text()
    )


@pytest.mark.parametrize("quantize_weights", [False, True])
def test_hpz_backward_gathers_stay_inside_the_node(mesh24, quantize_weights):
    local = 4
    cross = lambda text: [
        c for c in collectives_in_hlo(text) if c.kind == "all-gather" and c.spans_nodes(local)
    ]
    # Quantized weights travel as two collectives: codes and scales.
    per = 2 if quantize_weights else 1
    counts = {}
    for hpz in (False, True):
        cfg = ZeroPPConfig.zero3(hpz=hpz, quantize_weights=quantize_weights)
        compiled, layout = _compiled_step_hlo(mesh24, cfg)
        counts[hpz] = len(cross(compiled.as_text()))
        fwd = len(cross(_forward_hlo(mesh24, cfg, layout)))
        assert fwd == per  # one gather per layer, inside the scanned loop body
    # Without hpZ the backward re-gathers across nodes; with hpZ only the
    # forward's cross-node gather is left.
    assert counts == {False: 2 * per, True: per}
    compiled, _ = _compiled_step_hlo(
        mesh24, ZeroPPConfig.zero3(hpz=True, quantize_weights=quantize_weights)
    )
    gathers = [c for c in collectives_in_hlo(compiled.as_text()) if c.kind == "all-gather"]
    # hpZ gathers hierarchically: over `node` (2 devices: the secondary), then
    # over `local` in the forward, and over `local` alone in the backward.
    cross_gathers = [c for c in gathers if c.spans_nodes(local)]
    assert len(cross_gathers) == per and all(c.group_size == 2 for c in cross_gathers)
    intra = [c for c in gathers if not c.spans_nodes(local)]
    assert len(intra) == 2 * per and all(c.group_size == local for c in intra)


def _secondary_bytes(layout, config, nodes, local):
    n = nodes * local
    if config.quantize_weights:
        s = layout.shard_size
        return nodes * quant.wire_bytes(s, config.weight_bits, config.block_size)
    return n * layout.shard_size * 4 // local


@pytest.mark.parametrize(
    "config",
    [ZeroPPConfig.zero3(), ZeroPPConfig.zero3(hpz=True), ZeroPPConfig(), ZeroPPConfig(hpz=False)],
    ids=["zero3", "hpz", "zeropp", "qwz+qgz"],
)
def test_memory_growth_per_layer(mesh24, config):
    d, f, batch, tokens = 64, 256, 8, 32
    sizes = {}
    for layers in (8, 16):
        stack = jax.eval_shape(lambda layers=layers: init_stack(jax.random.key(0), layers, d, f))
        layout = FlatLayout.from_tree(stack, 8, stacked=True)
        step, _ = sharded_loss_and_grads(mesh24, config, layout)
        shards = jax.ShapeDtypeStruct(
            (layers, layout.padded_size),
            jnp.float32,
            sharding=NamedSharding(mesh24, shard_spec(True)),
        )
        x = jax.ShapeDtypeStruct(
            (batch, tokens, d), jnp.float32, sharding=NamedSharding(mesh24, P(AXES))
        )
        ma = step.lower(shards, x, None).compile().memory_analysis()
        sizes[layers] = np.array(
            [ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes]
        )
    arg, out, temp = (sizes[16] - sizes[8]) / 8
    shard_bytes = layout.shard_size * 4
    act_bytes = (batch // 8) * tokens * d * 4
    secondary = _secondary_bytes(layout, config, 2, 4) if config.hpz else 0
    full_weight = layout.padded_size * 4
    print(
        f"\n{config}: per layer arg {arg:.0f} out {out:.0f} temp {temp:.0f}; shard "
        f"{shard_bytes} secondary {secondary} activations {act_bytes} full weight {full_weight}"
    )
    assert arg == shard_bytes and out <= shard_bytes  # primary shard in, its gradient out
    assert temp <= secondary + act_bytes
    assert temp < full_weight / 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "config",
    [
        ZeroPPConfig.zero3(),
        ZeroPPConfig(quantize_gradients=False),
        ZeroPPConfig(weight_bits=4, hpz=False),
        ZeroPPConfig(gradient_bits=8, quantize_weights=False),
        ZeroPPConfig(error_feedback=True, residual_dtype="bfloat16"),
        ZeroPPConfig(block_size=6, weight_bits=4),
    ],
    ids=["zero3", "qwz+hpz", "qwz4", "qgz8", "ef", "tiny-block"],
)
def test_every_path_and_dtype(mesh24, dtype, config):
    stack, x = _data(8, dtype)
    ref_loss, ref_grads = reference_loss_and_grads(
        jax.tree.map(lambda a: a.astype(jnp.float32), stack), x.astype(jnp.float32)
    )
    loss, grads, r = _run(mesh24, config, stack, x)
    assert np.isfinite(float(loss))
    leaves = zip(
        jax.tree.leaves(grads), jax.tree.leaves(ref_grads), jax.tree.leaves(stack), strict=True
    )
    for g, rg, p in leaves:
        assert g.dtype == p.dtype and g.shape == p.shape
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
        assert _max_rel(np.asarray(g, np.float32), rg) < 0.5
    if config.error_feedback:
        assert r.dtype == jnp.bfloat16 and np.any(np.asarray(r, np.float32) != 0)


def test_all_zero_parameters_give_zeros_not_nan(mesh24):
    stack, x = _data(8)
    stack = jax.tree.map(jnp.zeros_like, stack)
    loss, grads, _ = _run(mesh24, ZeroPPConfig(weight_bits=4), stack, x)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_error_feedback_through_the_layer(mesh24):
    """A fixed batch, 50 steps: the mean of the qgZ gradients converges to the
    exact gradient with error feedback, not without."""
    stack, x = _data(8)
    shards, layout = shard_params(stack, mesh24, stacked=True)
    _, exact, _ = sharded_loss_and_grads(mesh24, ZeroPPConfig.zero3(), layout)[0](shards, x, None)
    errors = {}
    for ef in (False, True):
        cfg = ZeroPPConfig(quantize_weights=False, hpz=False, error_feedback=ef)
        f, layer = sharded_loss_and_grads(mesh24, cfg, layout)
        res = layer.init_residuals(mesh24, LAYERS) if ef else None
        total = 0
        for _ in range(50):
            _, g, res = f(shards, x, res)
            total = total + np.asarray(g)
        errors[ef] = np.abs(total / 50 - np.asarray(exact)).mean()
    assert errors[True] * 5 <= errors[False], errors


def test_bad_calls_are_named(mesh24):
    stack, x = _data(8)
    shards, layout = shard_params(stack, mesh24, stacked=True)
    layer = ShardedLayer(block, layout, ZeroPPConfig())
    with pytest.raises(ValueError, match="shard has shape"):
        layer(jnp.zeros(3), x)
    with pytest.raises(ValueError, match="error_feedback is off"):
        layer(jnp.zeros(layout.shard_size), x, jnp.zeros(4))
    ef = ShardedLayer(block, layout, ZeroPPConfig(error_feedback=True))
    with pytest.raises(ValueError, match="pass the layer's residual"):
        ef(jnp.zeros(layout.shard_size), x)
    with pytest.raises(ValueError, match="residual has dtype bfloat16"):
        ef(jnp.zeros(layout.shard_size), x, jnp.zeros(4, jnp.bfloat16))
    with pytest.raises(ValueError, match="does not match"):
        make_mesh(3, 3)


@pytest.mark.parametrize("bits", [4, 8])
def test_gradient_quantized_tensor_by_tensor_equals_flat(bits):
    """The blocks of the flat fp32 gradient, computed tensor by tensor
    (aligned leaves; gaps and padding as zero blocks), bit for bit."""
    from zpp_jax.layer import _quantize_flat_blocks

    tree = {"a": jnp.arange(-50.0, 50.0).reshape(4, 25), "b": jnp.full((3,), 7.0), "c": -2.5}
    layout = FlatLayout.from_tree(tree, 8, align=64)
    ref = quant.quantize(layout.flatten(tree), bits, 32)
    got = _quantize_flat_blocks(layout, tree, bits, 32)
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(ref.scales))


def test_aligned_layer_gradients_match_the_flat_quantization(mesh24, monkeypatch):
    """Through the whole layer: quantizing the gradient tensor by tensor gives
    the same shard gradients as quantizing the assembled flat vector."""
    import zpp_jax.layer as layer_module

    stack, x = _data(8)
    config = ZeroPPConfig()
    shards, layout = shard_params(stack, mesh24, stacked=True, align=config.alignment)
    f, _ = sharded_loss_and_grads(mesh24, config, layout)
    _, by_tensor, _ = f(shards, x, None)

    def flat(layout, tree, bits, block):
        return quant.quantize(layout.flatten(tree), bits, block)

    monkeypatch.setattr(layer_module, "_quantize_flat_blocks", flat)
    f, _ = sharded_loss_and_grads(mesh24, config, layout)
    _, by_flat, _ = f(shards, x, None)
    np.testing.assert_array_equal(np.asarray(by_tensor), np.asarray(by_flat))
    ref_grads = reference_loss_and_grads(stack, x)[1]
    grads = unshard_params(by_tensor, layout, stacked=True)
    for g, rg in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert _max_rel(g, rg) < 0.5
