import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from blocks import (
    loss_fn,
    per_device_flat_grads,
    reference_loss_and_grads,
    sharded_loss_and_grads,
    stack_loss,
    used_weights,
)
from bounds import two_rounding_bound
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax import UsageError, ZeroPPConfig, make_mesh, quant
from zpp_jax.analysis import collectives_in_hlo
from zpp_jax.lowlevel import (
    AXES,
    FlatLayout,
    ShardedLayer,
    from_primary_shards,
    mesh_shape,
    primary_spec,
    scan_layers,
    to_primary_shards,
)
from zpp_jax.models.blocks import block, init_stack

D, F, LAYERS = 16, 40, 3  # F=40: the flat size is not a multiple of 8 or of the block
EXACT = ZeroPPConfig.zero3(comm_dtype=None)  # fp32 wire: an unsharded model's numbers


@functools.cache
def _data(n_dev, dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(1), (n_dev, 6, D)).astype(dtype)
    stack = jax.jit(init_stack, static_argnums=(1, 2, 3, 4))(jax.random.key(0), LAYERS, D, F, dtype)
    return stack, x


def _run(mesh, config, stack, x, align=1, residuals=None):
    """(loss, flat shard gradients (layers, N*s), new residuals, shards, layout)."""
    shards, layout = to_primary_shards(stack, mesh, stacked=True, align=align)
    f, layer = sharded_loss_and_grads(mesh, config, layout)
    if config.error_feedback and residuals is None:
        residuals = layer.init_residuals(mesh, LAYERS)
    loss, g, r = f(shards, x, residuals)
    return loss, g, r, shards, layout


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def test_zero3_equals_unsharded_reference(mesh):
    stack, x = _data(mesh.devices.size)
    ref_loss, ref_grads = reference_loss_and_grads(stack, x)
    loss, g, _, _, layout = _run(mesh, EXACT, stack, x)
    grads = from_primary_shards(g, layout, stacked=True)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), r in zip(leaves, jax.tree.leaves(ref_grads), strict=True):
        assert _max_rel(g, r) <= 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    "remat",
    [
        pytest.param("none", marks=pytest.mark.slow),
        "dots",
        pytest.param(jax.checkpoint_policies.nothing_saveable, marks=pytest.mark.slow),
    ],
    ids=["none", "dots", "policy"],
)
def test_every_recomputation_policy_gives_the_same_gradients(mesh24, remat):
    """What a layer keeps for its backward pass changes memory and time, not
    the math: each policy's loss and gradients equal the full recomputation's
    up to fp32 round-off, with qwZ and hpZ (re-gathered weights) and without."""
    stack, x = _data(mesh24.devices.size)
    for config in (EXACT, EXACT.replace(hpz=True, quantize_weights=True)):
        a = config.alignment
        loss0, g0 = _run(mesh24, config.replace(remat="full"), stack, x, a)[:2]
        loss, g = _run(mesh24, config.replace(remat=remat), stack, x, a)[:2]
        assert abs(float(loss) - float(loss0)) <= 1e-6 * abs(float(loss0))
        assert _max_rel(g, g0) <= 1e-5


def test_hpz_equals_zero3(mesh):
    stack, x = _data(mesh.devices.size)
    g0 = _run(mesh, EXACT, stack, x)[1]
    g1 = _run(mesh, EXACT.replace(hpz=True), stack, x)[1]
    assert _max_rel(g1, g0) <= 1e-6


@functools.cache
def _compiled_step_hlo(mesh, config, layers=2):
    stack = jax.eval_shape(lambda: init_stack(jax.random.key(0), layers, D, F))
    layout = FlatLayout.from_tree(stack, mesh.devices.size, stacked=True)
    f, _ = sharded_loss_and_grads(mesh, config, layout)
    shards = jax.ShapeDtypeStruct(
        (layers, layout.padded_size), jnp.float32, sharding=NamedSharding(mesh, primary_spec(True))
    )
    x = jax.ShapeDtypeStruct((8, 6, D), jnp.float32, sharding=NamedSharding(mesh, P(AXES)))
    return f.lower(shards, x, None).compile().as_text(), layout


def _forward_hlo(mesh, config, layout, layers=2):
    layer = ShardedLayer(block, layout, config)
    f = jax.shard_map(
        lambda s, x: jax.lax.pmean(loss_fn(scan_layers(layer, s, x)), AXES),
        mesh=mesh,
        in_specs=(primary_spec(True), P(AXES)),
        out_specs=P(),
        check_vma=False,
    )
    return (
        jax.jit(f)
        .lower(jnp.zeros((layers, layout.padded_size)), jnp.zeros((8, 6, D)))
        .compile()
        .as_text()
    )


@pytest.mark.parametrize("quantize_weights", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_hpz_backward_gathers_stay_inside_the_node(mesh24, quantize_weights):
    local = 4
    cross = lambda text: [
        c for c in collectives_in_hlo(text) if c.kind == "all-gather" and c.spans_nodes(local)
    ]
    # Quantized weights travel as one message: codes, then scales.
    per = 1
    counts = {}
    for hpz in (False, True):
        cfg = EXACT.replace(hpz=hpz, quantize_weights=quantize_weights)
        text, layout = _compiled_step_hlo(mesh24, cfg)
        counts[hpz] = len(cross(text))
        fwd = len(cross(_forward_hlo(mesh24, cfg, layout)))
        assert fwd == per  # one gather per layer, inside the scanned loop body
    # Without hpZ the backward re-gathers across nodes; with hpZ only the
    # forward's cross-node gather is left.
    assert counts == {False: 2 * per, True: per}
    text, _ = _compiled_step_hlo(mesh24, EXACT.replace(hpz=True, quantize_weights=quantize_weights))
    gathers = [c for c in collectives_in_hlo(text) if c.kind == "all-gather"]
    # hpZ gathers hierarchically: over `node` (2 devices: the secondary), then
    # over `local` in the forward, and over `local` alone in the backward.
    cross_gathers = [c for c in gathers if c.spans_nodes(local)]
    assert len(cross_gathers) == per and all(c.group_size == 2 for c in cross_gathers)
    intra = [c for c in gathers if not c.spans_nodes(local)]
    assert len(intra) == 2 * per and all(c.group_size == local for c in intra)


def _collective_signature(mesh, config):
    """The per-layer collectives of a 2-layer training step (those the scan
    runs twice): the weight gathers as (group size, dtypes), the gradient
    reduction as (kind, group size, dtypes)."""
    text, _ = _compiled_step_hlo(mesh, config)
    per_layer = [c for c in collectives_in_hlo(text) if c.runs == 2]
    weights = sorted((c.group_size, c.dtypes) for c in per_layer if c.kind == "all-gather")
    grads = sorted((c.kind, c.group_size, c.dtypes) for c in per_layer if c.kind != "all-gather")
    return weights, grads


def test_each_switch_changes_only_its_own_collectives(mesh24):
    """Each technique switched on alone: what its collectives become, and
    that the other direction's collectives stay the baseline's."""
    f32, u8, u16, u32 = ("f32",), ("u8",), ("u16",), ("u32",)
    base_w, base_g = _collective_signature(mesh24, EXACT)
    # forward and backward gathers of fp32 bits; an fp32 reduce-scatter
    assert base_w == [(8, u32), (8, u32)] and base_g == [("reduce-scatter", 8, f32)]
    expected = {
        # qwZ: one message of bytes (codes, then scales), forward and backward
        "qwz": ({"quantize_weights": True}, [(8, u8)] * 2, base_g),
        "qwz int4": ({"quantize_weights": True, "weight_bits": 4}, [(8, u8)] * 2, base_g),
        # hpZ: over `node` then `local` forward, over `local` alone backward
        "hpz": ({"hpz": True}, [(2, u32), (4, u32), (4, u32)], base_g),
        # qgZ: bytes (codes, then bf16 scales) all-to-all inside the node,
        # then a permute of the other node's chunk across nodes
        "qgz": (
            {"quantize_gradients": True},
            base_w,
            [("all-to-all", 4, u8 * 4), ("collective-permute", 2, u8)],
        ),
        "qgz int8, fp32 scales": (
            {"quantize_gradients": True, "gradient_bits": 8, "gradient_scale_dtype": "float32"},
            base_w,
            [("all-to-all", 4, u8 * 4), ("collective-permute", 2, u8)],
        ),
        # a bf16 wire for the unquantized collectives: 16-bit payloads
        "bf16 wire": (
            {"comm_dtype": "bfloat16"},
            [(8, u16), (8, u16)],
            [("all-to-all", 8, u16 * 8)],
        ),
    }
    for name, (switch, weights, grads) in expected.items():
        got = _collective_signature(mesh24, EXACT.replace(**switch))
        assert got == (weights, grads), name


def _secondary_bytes(layout, config, nodes, local):
    n = nodes * local
    if config.quantize_weights:
        s = layout.shard_size
        return nodes * quant.wire_bytes(s, config.weight_bits, config.block_size)
    return n * layout.shard_size * 4 // local


_MEMORY_CASES = {
    "zero3-full": EXACT.replace(remat="full"),
    "hpz-full": EXACT.replace(hpz=True, remat="full"),
    "zeropp-full": ZeroPPConfig(remat="full"),
    "qwz+qgz-full": ZeroPPConfig(hpz=False, remat="full"),
    "zero3-dots": EXACT.replace(remat="dots"),
    "zeropp-dots": ZeroPPConfig(remat="dots"),
    "zero3-none": EXACT.replace(remat="none"),
    "zeropp-none": ZeroPPConfig(remat="none"),
}


def _sharded_step_bytes(mesh, config, layers, d, f_dim, batch, tokens):
    """(argument, output, temp) bytes per device of the compiled gradient
    step of a `layers`-block stack, and its layout."""
    stack = jax.eval_shape(lambda: init_stack(jax.random.key(0), layers, d, f_dim))
    layout = FlatLayout.from_tree(stack, 8, stacked=True)
    step, _ = sharded_loss_and_grads(mesh, config, layout)
    shards = jax.ShapeDtypeStruct(
        (layers, layout.padded_size), jnp.float32, sharding=NamedSharding(mesh, primary_spec(True))
    )
    x = jax.ShapeDtypeStruct((batch, tokens, d), jnp.float32, sharding=NamedSharding(mesh, P(AXES)))
    ma = step.lower(shards, x, None).compile().memory_analysis()
    sizes = [ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes]
    return np.array(sizes), layout


@functools.cache
def _plain_activation_bytes(d, f_dim, rows, tokens):
    """What plain autodiff keeps per block from its forward to its backward
    pass: the growth per added block of the temporaries of the unsharded
    stack's gradient on one device's `rows` (its weights are arguments, so
    its temporaries are the activations)."""

    def temp(layers):
        stack = jax.eval_shape(lambda: init_stack(jax.random.key(0), layers, d, f_dim))
        x = jax.ShapeDtypeStruct((rows, tokens, d), jnp.float32)
        compiled = jax.jit(jax.grad(stack_loss)).lower(stack, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    return (temp(16) - temp(8)) / 8


# ZeRO-3 without recomputation in the quick loop, the rest in the slow set.
_MEMORY_QUICK = ("zero3-none",)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(c, id=k, marks=() if k in _MEMORY_QUICK else pytest.mark.slow)
        for k, c in _MEMORY_CASES.items()
    ],
)
def test_memory_growth_per_layer(mesh24, config):
    """The ZeRO guarantee under every recomputation policy: from its forward
    to its backward pass a layer keeps what its policy saves (its input with
    "full"; at most what plain autodiff keeps with "dots" and "none") and the
    hpZ secondary, never its full weight. Read from the compiled step's
    memory_analysis(): the growth per added layer of a scanned stack."""
    d, f_dim, batch, tokens = 128, 512, 8, 16  # activations smaller than the weights
    (a8, layout), (a16, _) = (
        _sharded_step_bytes(mesh24, config, n, d, f_dim, batch, tokens) for n in (8, 16)
    )
    arg, out, temp = (a16 - a8) / 8
    shard_bytes = layout.shard_size * 4
    secondary = _secondary_bytes(layout, config, 2, 4) if config.hpz else 0
    full_weight = layout.padded_size * 4
    assert arg == shard_bytes and out <= shard_bytes  # primary shard in, its gradient out
    if config.remat == "full":
        kept = (batch // 8) * tokens * d * 4  # the layer's input
    else:
        kept = _plain_activation_bytes(d, f_dim, batch // 8, tokens)
    print(f"per layer: {temp:,.0f} B; kept activations {kept:,.0f} B, secondary {secondary:,} B")
    assert temp <= secondary + kept + 1024  # block padding of the secondary
    assert temp < full_weight / 2


def _check_against_reference(mesh, config, stack, x, flat_grads, shards, layout):
    """The sharded gradients against the unsharded model evaluated at the
    weights the layers actually computed with (qwZ: the dequantized codes):
    equal up to two roundings in the compute dtype (and fp32 round-off), plus,
    with qgZ, the two quantizations of the gradient reduction, elementwise
    (bounds.two_rounding_bound over each layer's per-device gradients)."""
    n = mesh.devices.size
    nodes, local = mesh_shape(mesh)
    # On one device, from host copies: the reference is a plain program,
    # not one partitioned over the mesh.
    weights = used_weights(jnp.asarray(np.asarray(shards)), layout, config)
    per_device = per_device_flat_grads(weights, layout, n, jnp.asarray(np.asarray(x)))
    per_device = np.asarray(per_device, np.float64)
    ref = per_device.mean(0)  # (layers, N*s): the engine averages over devices
    got = np.asarray(flat_grads, np.float64)
    scale = np.max(np.abs(ref))
    assert scale > 0
    dtype = jnp.result_type(jax.tree.leaves(stack)[0])
    slack = max(2 * float(jnp.finfo(dtype).eps), 1e-5) * scale
    bound = np.zeros_like(ref)
    if not config.quantize_gradients and config.comm_dtype is not None:
        # each device's gradient rounded to the wire dtype (relative error
        # at most half its eps), then summed in fp32
        half_eps = float(jnp.finfo(config.comm_dtype).eps) / 2
        bound = half_eps * np.abs(per_device).mean(0)
    if config.quantize_gradients:
        bound = np.stack(
            [
                two_rounding_bound(
                    per_device[:, i].astype(np.float32),
                    nodes,
                    local,
                    config.gradient_bits,
                    config.grad_block,
                    config.gradient_rounding,
                    config.gradient_scale_dtype,
                )
                for i in range(ref.shape[0])
            ]
        )
    excess = np.abs(got - ref) - (bound * (1 + 1e-4) + slack)
    assert np.all(excess <= 0), f"worst excess {np.max(excess) / scale:.3g} x scale"
    return ref, bound


CONFIGS = {
    "zero3": EXACT,
    "bf16-wire": ZeroPPConfig.zero3(),
    "qwz+hpz": ZeroPPConfig(quantize_gradients=False),
    "qwz4": ZeroPPConfig(weight_bits=4, hpz=False),
    "qgz8": ZeroPPConfig(gradient_bits=8, quantize_weights=False),
    "ef": ZeroPPConfig(error_feedback=True, residual_dtype="bfloat16"),
    "tiny-block": ZeroPPConfig(block_size=6, weight_bits=4),
}


# Every path in fp32 in the quick loop; every path in bf16 and the quantized
# ones in fp16 (whose narrow range is what their scales must survive) in the
# full suite.
_FP16 = ("qwz+hpz", "qwz4", "qgz8", "ef", "tiny-block")


@pytest.mark.parametrize(
    "name, dtype",
    [
        pytest.param(
            name,
            dtype,
            id=f"{name}-{jnp.dtype(dtype).name}",
            marks=() if dtype == jnp.float32 else pytest.mark.slow,
        )
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
        for name in CONFIGS
        if dtype != jnp.float16 or name in _FP16
    ],
)
def test_every_path_and_dtype(mesh24, dtype, name):
    config = CONFIGS[name]
    stack, x = _data(8, dtype)
    _, g, r, shards, layout = _run(mesh24, config, stack, x)
    _check_against_reference(mesh24, config, stack, x, g, shards, layout)
    grads = from_primary_shards(g, layout, stacked=True)
    for gl, p in zip(jax.tree.leaves(grads), jax.tree.leaves(stack), strict=True):
        assert gl.dtype == p.dtype and gl.shape == p.shape
    if config.error_feedback:  # the residual holds what the reduction rounded away
        assert r.dtype == jnp.bfloat16 and np.any(np.asarray(r, np.float32) != 0)


def test_all_zero_parameters_give_zeros_not_nan(mesh24):
    """All-zero weights quantize to zero blocks (scale 0): the layers compute
    exactly with zeros, and the gradients are the reference's within the
    reduction's bound, not NaN."""
    stack, x = _data(8)
    stack = jax.tree.map(jnp.zeros_like, stack)
    config = ZeroPPConfig(weight_bits=4)
    loss, g, _, shards, layout = _run(mesh24, config, stack, x)
    assert float(loss) == pytest.approx(float(reference_loss_and_grads(stack, x)[0]), rel=1e-6)
    _check_against_reference(mesh24, config, stack, x, g, shards, layout)


@pytest.mark.slow  # error feedback's residuals over steps stay in the loop (test_shard_linen)
def test_error_feedback_through_the_layer(mesh24):
    """A fixed batch, T steps: without error feedback every step rounds the
    gradient the same way; with it the rounding errors telescope and the mean
    gradient is within about twice the one-step bound over T of exact."""
    steps = 50
    stack, x = _data(8)
    base = ZeroPPConfig(quantize_weights=False, hpz=False)
    _, g, _, shards, layout = _run(mesh24, base, stack, x)
    exact, bound = _check_against_reference(mesh24, base, stack, x, g, shards, layout)
    errors = {}
    for ef in (False, True):
        f, layer = sharded_loss_and_grads(mesh24, base.replace(error_feedback=ef), layout)
        res = layer.init_residuals(mesh24, LAYERS) if ef else None
        total = np.zeros_like(exact)
        for _ in range(steps):
            _, g, res = f(shards, x, res)
            total += np.asarray(g, np.float64)
        errors[ef] = np.abs(total / steps - exact)
    assert np.all(errors[True] <= 2 * bound / steps + 1e-5 * np.max(np.abs(exact)))
    assert np.max(errors[False]) > 2 * np.max(bound) / steps


def test_bad_calls_are_named(mesh24):
    stack, x = _data(8)
    shards, layout = to_primary_shards(stack, mesh24, stacked=True)
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


@pytest.mark.slow  # every path's gradients stay in the loop
def test_aligned_layer_gradients_match_the_flat_quantization(mesh24, monkeypatch):
    """Through the whole layer: quantizing the gradient tensor by tensor gives
    the same shard gradients as quantizing the assembled flat vector."""
    stack, x = _data(8)
    # Nearest rounding: the two programs may round the fp32 gradient
    # differently in its last bit, and stochastic rounding, which hashes the
    # value's bits, would then round those elements independently.
    config = ZeroPPConfig(gradient_rounding="nearest")
    _, by_tensor, _, shards, layout = _run(mesh24, config, stack, x, align=config.alignment)
    assert layout.align % config.grad_block == 0  # the tensor-by-tensor path is taken
    _check_against_reference(mesh24, config, stack, x, by_tensor, shards, layout)

    def flat(layout, tree, bits, block, rounding, scale_dtype):
        return quant.quantize(
            layout.flatten(tree), bits, block, rounding=rounding, scale_dtype=scale_dtype
        )

    monkeypatch.setattr(FlatLayout, "quantize_gradient", flat)
    # A fresh trace (not the cached program), so that the patch takes effect.
    f, _ = sharded_loss_and_grads.__wrapped__(mesh24, config, layout)
    _, by_flat, _ = f(shards, x, None)
    # The same codes and scales; the two programs are fused differently, so
    # the fp32 sums after dequantization may round differently (a few ulps
    # of the largest gradient).
    a, b = np.asarray(by_tensor), np.asarray(by_flat)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)))


def test_prefetch_changes_the_order_not_the_math(mesh24):
    """`prefetch=True` (what units do on a GPU mesh) only frees the gathers
    from waiting for the layer's input and cotangent: with qwZ and hpZ on
    (the same int8 codes are gathered either way), the loss and gradients
    equal the tied order's to fp32 round-off. (Gradient quantization would
    turn a last-bit difference of fusion into a code step, so qgZ is off.)"""
    from zpp_jax.lowlevel import stack_value_and_grad

    stack, x = _data(mesh24.devices.size)
    config = ZeroPPConfig(quantize_gradients=False)
    shards, layout = to_primary_shards(stack, mesh24, stacked=True, align=config.alignment)
    outs = []
    for prefetch in (False, True):
        layer = ShardedLayer(block, layout, config, prefetch=prefetch)
        f = jax.jit(stack_value_and_grad(layer, mesh24, lambda out, x: loss_fn(out)))
        outs.append(f(shards, None, x))
    (loss0, g0, _), (loss1, g1, _) = outs
    assert abs(float(loss1) - float(loss0)) <= 1e-6 * abs(float(loss0))
    assert _max_rel(g1, g0) <= 1e-5
    with pytest.raises(UsageError, match="prefetch must be True or False"):
        ShardedLayer(block, layout, config, prefetch="yes")


def _relay_chain(mesh, config, relay):
    """Three relayed layers of different widths (one matrix each) in one
    shard_map; returns (the jitted gradients of the three shards and of the
    input, the arguments)."""
    from zpp_jax.overlap.relay import TOKEN_SIZE

    def fn(p, h):
        return jnp.tanh(h @ p["w"])

    dims, n = (16, 24, 32, 16), mesh.devices.size
    layers, shards = [], []
    for k in range(3):
        w = {"w": jax.random.normal(jax.random.key(k), dims[k : k + 2]) / 4}
        layout = FlatLayout.from_tree(w, n, align=config.alignment)
        layers.append(ShardedLayer(fn, layout, config, reduction="sum", prefetch=True))
        shards.append(layout.flatten(w))

    def local(*args):
        def loss(*args):
            h, token = args[-1], jnp.zeros((TOKEN_SIZE,), jnp.float32)
            for layer, shard in zip(layers, args[:-1], strict=True):
                if relay:
                    h, token = layer.relayed(shard, h, None, token)
                else:
                    h = layer(shard, h)
            return jnp.sum(h**2)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(*args)

    specs = (P(AXES),) * 4
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
    x = jax.random.normal(jax.random.key(9), (8, 4, dims[0]))
    return f, (*shards, x)


def _feeds(jaxpr, out) -> set:
    """ids of the equations `out` depends on. A static slice of a 1-D
    concatenation (a relay token) depends only on the pieces it covers."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    found, stack, seen = set(), [out], set()
    while stack:
        v = stack.pop()
        e = producer.get(v) if isinstance(v, jax.extend.core.Var) else None
        if e is None or id(v) in seen:
            continue
        seen.add(id(v))
        found.add(id(e))
        src = producer.get(e.invars[0]) if e.primitive.name == "slice" else None
        if src is not None and src.primitive.name == "concatenate" and e.outvars[0].aval.ndim == 1:
            (lo,), (hi,), at = e.params["start_indices"], e.params["limit_indices"], 0
            for piece in src.invars:
                if at < hi and lo < at + piece.aval.shape[0]:
                    stack.append(piece)
                at += piece.aval.shape[0]
            found.add(id(src))
            continue
        stack.extend(e.invars)
    return found


@pytest.mark.parametrize(
    "quantized", [pytest.param(True, marks=pytest.mark.slow), False], ids=["qgz", "zero3"]
)
def test_relayed_reductions_finish_a_layer_or_two_later(quantized, mesh24):
    """Relayed (`ShardedLayer.relayed`), a layer's input cotangent waits for
    the next layer's whole reduction when it has one step (ZeRO-3's
    all-to-all), and for qgZ's two steps a layer apart: the next layer's
    all-to-all inside the node, the permute across nodes of the layer after
    that. Checked on the gradient's program (which collective the input's
    gradient depends on; backward order: layer 2, 1, 0), and the gradients
    equal the unrelayed layers' to fp32 round-off."""
    config = ZeroPPConfig() if quantized else ZeroPPConfig.zero3(comm_dtype="bfloat16")
    f, args = _relay_chain(mesh24, config, relay=True)
    (body,) = [
        e.params["jaxpr"] for e in jax.make_jaxpr(f)(*args).eqns if e.primitive.name == "shard_map"
    ]
    waits = _feeds(body, body.outvars[3])

    def fed(name):
        return [id(e) in waits for e in body.eqns if e.primitive.name == name]

    assert fed("all_to_all") == [True, True, False]
    assert fed("ppermute") == ([True, False, False] if quantized else [])
    got = jax.jit(f)(*args)
    want = jax.jit(_relay_chain(mesh24, config, relay=False)[0])(*args)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7 * float(jnp.max(jnp.abs(b))))
