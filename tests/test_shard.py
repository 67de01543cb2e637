"""`zpp.shard` on NNX models written as users write them (tests/zoo.py):
the standard NNX loop, exact against one device with ZeRO-3 on an fp32
wire, training with full ZeRO++, the ZeRO memory guarantee, and bad input."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zpp_jax as zpp

EXACT = zpp.ZeroPPConfig.zero3(comm_dtype=None)  # fp32 wire and compute
FULL = zpp.ZeroPPConfig()  # all three techniques, as they come
FAMILIES = {f.name: f for f in zoo.nnx_families()}


LR = 1e-3
# Of the learning rate per element and step: how far fp32 rounding may carry
# Adam's updates apart (see test_zero3_equals_one_device).
_ADAM_SLACK = 1e-4


def ndim_mask(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def optimizer():
    """What a user writes: clipping by the global norm, AdamW decaying only
    the matrices."""
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=0.1, mask=ndim_mask)
    )


@pytest.mark.slow  # two steps of a second model
def test_persistence_threshold_keeps_small_parameters_whole(mesh24):
    """Parameters under `persistence_threshold` elements (the Llama's norm
    scales, 64) are whole on every device, the others sharded; the final
    norm, a unit of its own, then runs no collective (one gather, one
    re-gather and one reduce-scatter fewer), and the loss and gradients are
    the fully sharded step's (ZeRO-3, fp32 wire) to fp32 round-off."""
    from zpp_jax.analysis import collectives_in_hlo
    from zpp_jax.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=2)
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    out = {}
    for threshold in (0, 100):
        config = EXACT.replace(persistence_threshold=threshold)
        model = zpp.shard(Llama(cfg, nnx.Rngs(0)), mesh24, config)
        graphdef, state = nnx.split(model)
        step = lm_gradient_step(graphdef, tokens)
        kinds = [c.kind for c in collectives_in_hlo(step.lower(state).compile().as_text())]
        params = nnx.to_flat_state(nnx.state(model, nnx.Param))
        whole = {p for p, v in params if v.get_value().sharding.is_fully_replicated}
        out[threshold] = step(state), kinds, whole
    (loss, grads), kinds, whole = out[100]
    (ref_loss, ref_grads), ref_kinds, ref_whole = out[0]
    assert not ref_whole and whole and all("norm" in "/".join(map(str, p)) for p in whole)
    for kind, fewer in (("all-gather", 2), ("reduce-scatter", 1)):
        assert kinds.count(kind) == ref_kinds.count(kind) - fewer, (kinds, ref_kinds)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert _rel(g, r) <= 1e-5


def lm_gradient_step(graphdef, tokens):
    """The jitted loss and gradients of a language model's state."""

    @jax.jit
    def step(state):
        loss = lambda m: zpp.train.cross_entropy(m(tokens), tokens)  # noqa: E731
        return zpp.value_and_grad(loss)(nnx.merge(graphdef, state))

    return step


def relay_as_on_a_gpu(monkeypatch):
    """From here on, CPU meshes relay their units as GPU meshes do, and
    layer loops are unrolled to relay theirs (the values are the same; only
    the order a GPU may run them in changes)."""
    for module in ("zpp_jax.unit", "zpp_jax.sharded"):
        monkeypatch.setattr(importlib.import_module(module), "prefetches", lambda mesh: True)


def test_shard_replicates_the_models_other_arrays_on_the_mesh(mesh24):
    """Random-stream keys and counts (dropout) and batch statistics, which
    Flax makes on one device, are whole on every device after `zpp.shard`:
    a jitted step takes them as it returns them (one compile)."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 16, rngs=rngs)
            self.norm = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.norm(self.lin(x)))

    model = zpp.shard(Net(nnx.Rngs(0)), mesh24)
    others = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
    assert len(others) >= 4  # batch mean and variance, a key and a count
    for a in others:
        assert a.sharding == NamedSharding(mesh24, P()), a.sharding
    traces = []

    @nnx.jit
    def step(model, x):
        traces.append(1)
        return model(x)

    x = jax.device_put(np.ones((8, 16), np.float32), zpp.batch_sharding(mesh24))
    first, second = step(model, x), step(model, x)
    assert len(traces) == 1 and not np.array_equal(first, second)  # new dropout masks


def _args(batch):
    return (batch["inputs"],) + ((batch["decoder_inputs"],) if "decoder_inputs" in batch else ())


def train(family, model, steps, mesh=None):
    """The standard NNX loop: `nnx.Optimizer`, `nnx.value_and_grad`,
    `nnx.jit`. Returns the losses and the model."""
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)
    if mesh is not None:
        zpp.on_mesh(opt, mesh)

    @nnx.jit
    def step(model, opt, batch):
        def loss_fn(model):
            return family.loss(model(*_args(batch)), batch)

        loss, grads = zpp.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    losses = []
    for i in range(steps):
        batch = family.batch(i)
        if mesh is not None:
            batch = jax.device_put(batch, zpp.batch_sharding(mesh))
        losses.append(float(step(model, opt, batch)))
    return losses, model


def _params(model):
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _rel(a, b):
    """Largest difference relative to the largest magnitude (elementwise)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _norm_rel(a, b):
    """||a - b|| / ||b|| over one tensor."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.cache
def _single_device(name, steps):
    return train(FAMILIES[name], FAMILIES[name].make(0), steps)


# The MLP of 5 widths in the quick loop; the other families in the slow set.
_SLOW_FAMILIES = (
    "encoder_decoder",
    "different_widths",
    "llama_scan",
    "llama_list",
    "tied_embedding",
)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_FAMILIES else n for n in FAMILIES],
)
def test_zero3_equals_one_device(name, mesh24):
    """10 steps of ZeRO-3 (fp32 wire) with clipping and a masked AdamW: the
    losses equal one device's training to 1e-5, and so does every parameter
    tensor after `zpp.unshard`, tensor by tensor in norm, give or take 1e-4
    of the distance Adam can move it (`_ADAM_SLACK`); each parameter keeps
    its path, shape and dtype. The slack is for Adam's update g / (|g| + eps),
    which carries the fp32 rounding of a gradient (sums in another order)
    into the update at the gradient's relative size, not the parameter's: a
    bias or norm parameter that starts at 0 or 1 has moved only by its ten
    updates, and differs by up to 1e-4 of itself (seen on AVX-512 CPUs). A
    wrong gradient moves elements by up to the learning rate per step,
    10^4 times the slack."""
    family = FAMILIES[name]
    ref_losses, ref = _single_device(name, 10)
    model = zpp.shard(family.make(0), mesh24, EXACT)
    sharded = _params(model)
    assert {k: (v.shape, v.dtype) for k, v in sharded.items()} == {
        k: (v.shape, v.dtype) for k, v in _params(ref).items()
    }
    losses, model = train(family, model, 10, mesh24)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-5
    plain, want = _params(zpp.unshard(model)), _params(ref)
    assert plain.keys() == want.keys()
    for key, value in plain.items():
        assert value.get_value().sharding.is_fully_replicated
        got, ref = np.asarray(value.get_value()), np.asarray(want[key].get_value())
        slack = _ADAM_SLACK * LR * 10 * np.sqrt(ref.size)
        assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref) + slack, key


def _loss_and_grads(family, config, mesh):
    model = zpp.shard(family.make(0), mesh, config)
    batch = jax.device_put(family.batch(0), zpp.batch_sharding(mesh))

    @nnx.jit
    def f(model):
        return zpp.value_and_grad(lambda m: family.loss(m(*_args(batch)), batch))(model)

    loss, grads = f(model)
    return float(loss), jax.tree.leaves(grads)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("llama_list", marks=pytest.mark.slow),
        "llama_scan",
        pytest.param("tied_embedding", marks=pytest.mark.slow),
    ],
)
def test_gpu_order_changes_the_order_not_the_math(name, mesh24, monkeypatch):
    """On a GPU mesh the units prefetch and relay (`ShardedLayer.relayed`:
    each unit's gathers and reductions are tied to its neighbours' in the
    order the program runs them), and a layer loop is unrolled to relay its
    layers (`zpp_jax/overlap/loops.py`). On an unrolled decoder, a scanned one and
    a model that calls its embedding twice (as input and as output layer),
    the loss and every gradient equal the CPU order's to fp32 round-off,
    with qwZ and hpZ on (qgZ off: it would turn a last-bit difference of
    fusion into a code step). Every unit call is relayed."""
    from zpp_jax.layer import ShardedLayer

    family = FAMILIES[name]
    config = zpp.ZeroPPConfig(quantize_gradients=False)
    want_loss, want = _loss_and_grads(family, config, mesh24)
    calls = []
    relayed = ShardedLayer.relayed
    relay_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(
        ShardedLayer, "relayed", lambda self, *a: calls.append(1) or relayed(self, *a)
    )
    loss, got = _loss_and_grads(family, config, mesh24)
    assert len(calls) >= 3
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= 1e-6


def test_a_unit_of_vectors_is_left_out_of_the_relay(mesh24, monkeypatch):
    """On a GPU mesh a unit whose parameters are all vectors (a norm
    between two layers) has no matrix multiply of its weights, so its
    backward pass is no window for its neighbours' communication: it is
    called unrelayed, and the layers on either side relay to each other.
    The loss and gradients equal the CPU order's."""
    from zpp_jax.layer import ShardedLayer

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(16, 32, rngs=rngs)
            self.norm = nnx.LayerNorm(32, rngs=rngs)
            self.b = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.b(self.norm(jnp.tanh(self.a(x))))

    config = zpp.ZeroPPConfig.zero3(comm_dtype=None)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 16)), zpp.batch_sharding(mesh24))

    def loss_and_grads():
        model = zpp.shard(Net(nnx.Rngs(0)), mesh24, config)
        loss, grads = nnx.jit(zpp.value_and_grad(lambda m: jnp.sum(m(x) ** 2)))(model)
        return float(loss), jax.tree.leaves(grads)

    want_loss, want = loss_and_grads()
    calls = []
    for name in ("__call__", "relayed"):
        method = getattr(ShardedLayer, name)
        monkeypatch.setattr(
            ShardedLayer,
            name,
            lambda self, *a, name=name, method=method: calls.append(name) or method(self, *a),
        )
    relay_as_on_a_gpu(monkeypatch)
    loss, got = loss_and_grads()
    assert calls == ["relayed", "__call__", "relayed"]
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= 1e-6


@pytest.mark.slow  # the Linen model's case stays in the loop
def test_error_feedback_residuals_carry_over(mesh24):
    """With error feedback each unit holds a residual; `zpp.value_and_grad`
    writes the new one into the model every step, and the optimizer never
    sees it."""
    family = FAMILIES["mlp_5_widths"]
    model = zpp.shard(family.make(0), mesh24, zpp.ZeroPPConfig(error_feedback=True))
    residuals = nnx.state(model, zpp.lowlevel.FeedbackResidual)
    assert len(jax.tree.leaves(residuals)) == 5
    assert all(float(jnp.max(jnp.abs(r))) == 0 for r in jax.tree.leaves(residuals))
    losses, model = train(family, model, 3, mesh24)
    after = jax.tree.leaves(nnx.state(model, zpp.lowlevel.FeedbackResidual))
    assert all(float(jnp.max(jnp.abs(r))) > 0 for r in after)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


class _SquareHead(nnx.Module):
    """A final norm and a projection to the model's own width: every
    variable has the same leading size, as in a stack of layers."""

    def __init__(self, d, rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return self.proj(self.ln(x))


class _WithSquareHead(nnx.Module):
    def __init__(self, d, rngs):
        self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(2)])
        self.head = _SquareHead(d, rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.head(x)


def test_a_layer_whose_sizes_agree_is_not_a_stack(mesh24):
    """A head of a norm over d and a d -> d projection is one unit, not a
    stack of d layers: with error feedback its residual fits its call and
    the model trains."""
    model = zpp.shard(
        _WithSquareHead(16, nnx.Rngs(0)), mesh24, zpp.ZeroPPConfig(error_feedback=True)
    )
    x = jax.device_put(jnp.ones((8, 16)), zpp.batch_sharding(mesh24))
    opt = zpp.on_mesh(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), mesh24)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = zpp.value_and_grad(lambda m: jnp.mean(jnp.square(m(x) - 1.0)))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, x)) for _ in range(3)]
    assert losses[-1] < losses[0]
    residuals = jax.tree.leaves(nnx.state(model.head, zpp.lowlevel.FeedbackResidual))
    assert len(residuals) == 1 and residuals[0].ndim == 1


class _NormLayer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(32, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(32, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.norm(self.lin(x)))


class _Norms(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([_NormLayer(rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_batch_norm_statistics_are_the_global_batch(mesh24):
    """BatchNorm inside units: outputs, running statistics and gradients
    equal one device's on the same global batch, although each device sees
    2 of its 16 rows."""
    x = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32) * 3 + 1
    ref, model = _Norms(nnx.Rngs(0)), zpp.shard(_Norms(nnx.Rngs(0)), mesh24, EXACT)

    def loss(m, x):
        return jnp.mean(jnp.sin(m(x)))

    step = nnx.jit(nnx.value_and_grad(loss))
    l1, g1 = step(ref, x)
    l2, g2 = step(model, jax.device_put(x, zpp.batch_sharding(mesh24)))
    assert abs(float(l1) - float(l2)) <= 1e-5 * abs(float(l1))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert _rel(b, a) <= 1e-5
    for layer_ref, layer in zip(ref.layers, model.layers, strict=True):
        for stat in ("mean", "var"):
            want = getattr(layer_ref.norm, stat).get_value()
            assert _rel(getattr(layer.norm, stat).get_value(), want) <= 1e-5
            assert float(jnp.max(jnp.abs(want))) > 0.01  # the statistics moved


def test_dropout_masks_differ_across_devices_and_follow_the_seed(mesh24):
    class Drop(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(32, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Drop(rngs) for _ in range(2)])

        def __call__(self, x):
            return self.layers[1](self.layers[0](x))

    x = jax.device_put(jnp.ones((16, 32)), zpp.batch_sharding(mesh24))

    def masks(seed):
        model = zpp.shard(Net(nnx.Rngs(seed)), mesh24, EXACT)
        out = nnx.jit(lambda m, x: m.layers[0](x))(model, x)
        return np.asarray(out) == 0

    a, b, c = masks(0), masks(0), masks(1)
    np.testing.assert_array_equal(a, b)  # reproducible from the seed
    assert not np.array_equal(a, c)
    rows = a.reshape(8, 2, 32)  # device d holds rows 2d, 2d + 1
    assert len({r.tobytes() for r in rows}) == 8  # every device its own mask
    assert 0.3 < a.mean() < 0.7


def test_masked_loss_over_the_global_batch(mesh24):
    """A masked mean written as on one device is the global batch's, with
    the mask spread unevenly over the devices."""
    family = FAMILIES["llama_list"]
    ref, model = family.make(0), zpp.shard(family.make(0), mesh24, EXACT)
    batch = family.batch(0)
    mask = np.zeros((16, zoo.SEQ), np.float32)
    mask[:3, :5] = 1  # rows of the first two devices only
    mask[9, :] = 1

    def loss(m, batch, mask):
        logp = jax.nn.log_softmax(m(batch["inputs"]))
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    step = nnx.jit(nnx.value_and_grad(loss))
    l1, g1 = step(ref, batch, mask)
    put = functools.partial(jax.device_put, device=zpp.batch_sharding(mesh24))
    l2, g2 = step(model, put(batch), put(mask))
    assert abs(float(l1) - float(l2)) <= 1e-5 * float(l1)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert _rel(b, a) <= 1e-5


def test_optax_multi_transform_by_path(mesh24):
    """Parameters keep their paths: `optax.multi_transform` labelled by path
    (here: freeze the first layer) gives the one-device result."""
    family = FAMILIES["mlp_5_widths"]

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if "0" in jax.tree_util.keystr(path)[:14] else "train",
            params,
        )

    tx = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)

    def run(model, mesh):
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        batch = family.batch(0)
        if mesh is not None:
            batch = jax.device_put(batch, zpp.batch_sharding(mesh))

        @nnx.jit
        def step(model, opt, batch):
            grads = nnx.grad(lambda m: family.loss(m(batch["inputs"]), batch))(model)
            opt.update(model, grads)

        before = np.asarray(model.layers[0].kernel.get_value())
        step(model, opt, batch)
        return before, model

    before, ref = run(family.make(0), None)
    _, model = run(zpp.shard(family.make(0), mesh24, EXACT), mesh24)
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel.get_value()), before)
    for key, value in _params(zpp.unshard(model)).items():
        assert _norm_rel(value.get_value(), _params(ref)[key].get_value()) <= 1e-5


def test_unshard_gives_a_plain_model(mesh24):
    family = FAMILIES["tied_embedding"]
    model = zpp.shard(family.make(0), mesh24, zpp.ZeroPPConfig(error_feedback=True))
    plain = zpp.unshard(model)
    assert (
        type(plain.blocks[0]) is zoo.EncoderLayer and type(model.blocks[0]) is not zoo.EncoderLayer
    )
    assert not jax.tree.leaves(nnx.state(plain, zpp.lowlevel.FeedbackResidual))
    tokens = family.batch(0)["inputs"]
    np.testing.assert_allclose(plain(tokens), family.make(0)(tokens), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="made by zpp.shard"):
        zpp.unshard(family.make(0))


D, HIDDEN, ROWS = 64, 1024, 16


class _Deep(nnx.Module):
    """Identical residual layers: a Python list, or a stack run by `nnx.scan`."""

    def __init__(self, layers, scan, rngs):
        self.scan = scan
        if scan:

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return zoo.Residual(D, HIDDEN, rngs)

            self.layers = make(rngs)
        else:
            self.layers = nnx.List([zoo.Residual(D, HIDDEN, rngs) for _ in range(layers)])

    def __call__(self, x):
        if self.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, layer):
                return layer(x)

            return run(x, self.layers)
        for layer in self.layers:
            x = layer(x)
        return x


def _temp_bytes(mesh, config, layers, scan):
    model = zpp.shard(_Deep(layers, scan, nnx.Rngs(0)), mesh, config)
    graphdef, state = nnx.split(model)
    x = jax.ShapeDtypeStruct((ROWS, zoo.SEQ, D), jnp.float32, sharding=zpp.batch_sharding(mesh))

    def grads(state, x):
        return nnx.grad(lambda m: jnp.mean(m(x) ** 2))(nnx.merge(graphdef, state))

    return jax.jit(grads).lower(state, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # the layer's memory per layer stays in the loop (test_layer)
@pytest.mark.parametrize(
    "config",
    [
        EXACT.replace(remat="full"),
        zpp.ZeroPPConfig(remat="full"),
        zpp.ZeroPPConfig(hpz=False, remat="full"),
    ],
    ids=["zero3", "zeropp", "qwz+qgz"],
)
def test_memory_per_unit_is_its_input_and_secondary_not_its_weights(mesh24, config):
    """The ZeRO guarantee on the new path. In a scanned stack one more layer
    adds to the compiled gradient step's temporaries at most what the layer
    keeps for its backward pass: its input, and what it re-gathers from (the
    hpZ secondary: int8 with qwZ, 1/local of the unit; without hpZ a copy of
    its own 1/N block). In a list, whose unrolled layers the compiler
    schedules, under half of a unit's full weights. Never the full weights.
    (With remat="full"; tests/test_layer.py bounds every policy.)"""
    weights = (2 * D * HIDDEN + D + HIDDEN + 2 * D) * 4
    unit_input = ROWS // 8 * zoo.SEQ * D * 4
    if config.hpz:
        kept = 2 * zpp.quant.wire_bytes(-(-weights // 4 // 8), 8, config.block_size)
    else:
        kept = -(-weights // 8 // 4) * 4  # the 1/N block, fp32
    scan = (_temp_bytes(mesh24, config, 8, True) - _temp_bytes(mesh24, config, 4, True)) / 4
    unrolled = (_temp_bytes(mesh24, config, 4, False) - _temp_bytes(mesh24, config, 2, False)) / 2
    print(
        f"per unit: scan {scan:,.0f} B, list {unrolled:,.0f} B; input {unit_input:,}, "
        f"re-gathered from {kept:,}, full weights {weights:,}"
    )
    assert scan <= unit_input + kept + 1024  # block padding
    assert unrolled < weights / 2


# -- what units return and sow --------------------------------------------------------


def _moe_losses(model, mesh=None, steps=4):
    """(loss, balance loss) per step of Adam on a regression with a 0.1
    load-balancing term."""
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    if mesh is not None:
        zpp.on_mesh(opt, mesh)

    @nnx.jit
    def step(model, opt, x, y):
        def loss_fn(m):
            out, aux = m(x)
            return jnp.mean(jnp.square(out - y)) + 0.1 * aux, aux

        (loss, aux), grads = zpp.value_and_grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        return loss, aux

    rng, out = np.random.default_rng(5), []
    for _ in range(steps):
        x = rng.standard_normal((zoo.BATCH, 16)).astype(np.float32)
        y = rng.standard_normal(zoo.BATCH).astype(np.float32)
        if mesh is not None:
            x, y = jax.device_put((x, y), zpp.batch_sharding(mesh))
        out.append([float(v) for v in step(model, opt, x, y)])
    return np.array(out)


def test_a_statistic_of_the_batch_inside_a_unit_is_refused(mesh24):
    """A unit runs on its device's rows: an output that is not per example
    (an MoE layer's balance loss, a count) raises, naming the unit, the
    output and the fixes, before anything runs; 'mean' of a count too."""
    x = jax.device_put(np.ones((zoo.BATCH, 16), np.float32), zpp.batch_sharding(mesh24))
    model = zpp.shard(zoo.MoENet(nnx.Rngs(0)), mesh24, EXACT)
    with pytest.raises(ValueError) as refused:
        nnx.jit(lambda m, x: m(x))(model, x)
    assert (
        "unit layers/0 returned output[1] of shape () (float32), which is not per example (its "
        "leading axis is not this device's 2 rows of the batch)" in str(refused.value)
    )
    assert "outputs='mean'" in str(refused.value) and "outputs" in str(refused.value)

    class Count(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            y = self.lin(x)
            return y, jnp.sum(y > 0.5)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Count(rngs), Count(rngs)])

        def __call__(self, x):
            return self.layers[1](self.layers[0](x)[0])

    want = Net(nnx.Rngs(0))(np.asarray(x))[1]
    for outputs, error in ((None, "not per example"), ("mean", "int32 and cannot be averaged")):
        with pytest.raises(ValueError, match=error):
            nnx.jit(lambda m, x: m(x))(
                zpp.shard(Net(nnx.Rngs(0)), mesh24, EXACT, outputs=outputs), x
            )
    counted = nnx.jit(lambda m, x: m(x))(
        zpp.shard(Net(nnx.Rngs(0)), mesh24, EXACT, outputs="sum"), x
    )[1]
    assert int(counted) == int(want) and int(want) > 2
    with pytest.raises(ValueError, match="outputs='max'"):
        zpp.shard(Net(nnx.Rngs(0)), mesh24, outputs="max")


@pytest.mark.slow  # training runs
def test_an_moe_balance_loss_from_declared_means_trains_exactly(mesh24):
    """Returned as the two batch means it is made of, declared 'mean', and
    combined outside the units, the balance loss and the training losses
    equal one device's to 1e-6 step by step, and the parameters to 1e-5. A
    balance loss computed inside the unit and declared 'mean' instead is
    the mean of the devices' losses, not the batch's: far from it."""
    ref = zoo.MoENet(nnx.Rngs(0), "means")
    want = _moe_losses(ref)
    model = zpp.shard(zoo.MoENet(nnx.Rngs(0), "means"), mesh24, EXACT, outputs="mean")
    got = _moe_losses(model, mesh24)
    assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-6
    for a, b in zip(
        jax.tree.leaves(nnx.state(zpp.unshard(model), nnx.Param)),
        jax.tree.leaves(nnx.state(ref, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    inside = zpp.shard(zoo.MoENet(nnx.Rngs(0)), mesh24, EXACT, outputs="mean")
    wrong = _moe_losses(inside, mesh24, steps=1)
    assert abs(wrong[0, 1] - _moe_losses(zoo.MoENet(nnx.Rngs(0)), steps=1)[0, 1]) > 1e-2


class _Sowing(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.lin(x))
        self.sow(nnx.Intermediate, "h", h)  # per example
        self.sow(nnx.Intermediate, "mean_act", jnp.mean(jnp.abs(h)))  # over the batch
        return x + h


class _SowingNet(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([_Sowing(rngs), _Sowing(rngs)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
def test_sown_values_inside_units(mesh24):
    """`sow` inside a unit, with `nnx.capture` and as attributes: the
    per-example values come back as the global batch and a batch mean
    declared 'mean' as one device's, each equal to the plain model's; a
    batch mean not declared raises like an output."""
    x = np.random.default_rng(0).standard_normal((zoo.BATCH, 16)).astype(np.float32)
    placed = jax.device_put(x, zpp.batch_sharding(mesh24))
    capture = nnx.jit(lambda m, x: nnx.capture(m, nnx.Intermediate)(x))
    want_out, want = capture(_SowingNet(nnx.Rngs(0)), x)
    with pytest.raises(ValueError, match=r"unit layers/0 returned sow\['mean_act'\]\[0\] of"):
        capture(zpp.shard(_SowingNet(nnx.Rngs(0)), mesh24, EXACT), placed)
    out, got = capture(zpp.shard(_SowingNet(nnx.Rngs(0)), mesh24, EXACT, outputs="mean"), placed)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # Without nnx.capture, sown into attributes of the model.
    plain, model = (
        _SowingNet(nnx.Rngs(0)),
        zpp.shard(_SowingNet(nnx.Rngs(0)), mesh24, EXACT, outputs="mean"),
    )
    plain(x)
    nnx.jit(lambda m, x: m(x))(model, placed)
    got, want = nnx.state(model, nnx.Intermediate), nnx.state(plain, nnx.Intermediate)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


class _Decoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.layers = nnx.List(
            [nnx.MultiHeadAttention(2, 16, decode=True, rngs=rngs) for _ in range(2)]
        )
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_decoding_caches_split_with_the_batch(mesh24):
    """`nnx.MultiHeadAttention(decode=True)` keeps its keys and values in
    `nnx.Cache`s of the global batch: inside a unit they are split with
    the batch, so a sharded model decodes token by token with the logits
    of `zpp.unshard`'s and of the model's own."""
    length = 5
    tokens = np.random.default_rng(0).integers(0, 32, (zoo.BATCH, length)).astype(np.int32)

    def decode(model, place):
        for layer in model.layers:
            layer.init_cache((zoo.BATCH, length, 16))
        step = nnx.jit(lambda m, t: m(t))
        return np.stack([step(model, place(tokens[:, i : i + 1])) for i in range(length)], 1)

    want = decode(_Decoder(nnx.Rngs(0)), lambda t: t)
    model = zpp.shard(_Decoder(nnx.Rngs(0)), mesh24, EXACT)
    got = decode(model, lambda t: jax.device_put(t, zpp.batch_sharding(mesh24)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(decode(zpp.unshard(model), lambda t: t), got, rtol=1e-5, atol=1e-6)


# -- bad input ------------------------------------------------------------------


def test_bad_input_is_named(mesh24):
    family = FAMILIES["mlp_5_widths"]
    with pytest.raises(ValueError, match="selected no unit"):
        zpp.shard(family.make(0), mesh24, policy=lambda path, m: False)
    with pytest.raises(ValueError, match="units overlap: layers/1 contains layers/1/up"):
        zpp.shard(
            FAMILIES["different_widths"].make(0),
            mesh24,
            policy=[("layers", 1), ("layers", 1, "up")],
        )
    with pytest.raises(ValueError, match="does not have"):
        zpp.shard(family.make(0), mesh24, policy=[("nope",)])

    class Counter(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)
            self.count = nnx.Param(jnp.zeros((), jnp.int32))

    with pytest.raises(ValueError, match="count has dtype int32.*nnx.Variable"):
        zpp.shard(Counter(nnx.Rngs(0)), mesh24)
    flat = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with pytest.raises(ValueError, match=r"mesh has axes \('data',\); the engine needs"):
        zpp.shard(family.make(0), flat)
    with pytest.raises(ValueError, match="8 devices"):
        zpp.shard(family.make(0), zpp.make_mesh(4, 4))
    with pytest.raises(ValueError, match="Flax NNX module.*shard_linen"):
        zpp.shard(zoo.CNN(), mesh24)
    model = zpp.shard(family.make(0), mesh24)
    x = jax.device_put(np.zeros((12, 32), np.float32), NamedSharding(mesh24, P()))
    with pytest.raises(ValueError, match="batch of 12 rows.*multiple of 8"):
        nnx.jit(lambda m, x: m(x))(model, x)
    with pytest.raises(ValueError, match=r"already sharded \(zpp.shard ran on it\).*zpp.unshard"):
        zpp.shard(model, mesh24)
    with pytest.raises(ValueError, match="block_size=100,000 is larger than the model's largest"):
        zpp.shard(family.make(0), mesh24, zpp.ZeroPPConfig(block_size=100_000))


def test_a_sharded_model_called_outside_jit_equals_the_model(mesh24):
    """Called eagerly, each unit compiles its own call: the same outputs
    as the model it was sharded from (and as under `nnx.jit`)."""
    family = FAMILIES["mlp_5_widths"]
    batch = family.batch(0)
    want = family.make(0)(*_args(batch))
    model = zpp.shard(family.make(0), mesh24, EXACT)
    np.testing.assert_allclose(model(*_args(batch)), want, rtol=1e-6, atol=1e-6)
    jitted = nnx.jit(lambda m, *a: m(*a))(model, *_args(batch))
    np.testing.assert_allclose(jitted, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("placed", [False, True])
def test_on_mesh_makes_the_standard_loop_compile_once(mesh24, placed):
    """`nnx.Optimizer` makes its step counters on one device; they come back
    from the first step replicated, so `nnx.jit` traces the step again.
    `zpp.on_mesh(optimizer, mesh)` puts them on the mesh first: one trace."""
    family = FAMILIES["mlp_5_widths"]
    model = zpp.shard(family.make(0), mesh24, EXACT)
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)
    if placed:
        assert zpp.on_mesh(opt, mesh24) is opt
    traces = []

    @nnx.jit
    def step(model, opt, batch):
        traces.append(1)
        loss, grads = zpp.value_and_grad(lambda m: family.loss(m(*_args(batch)), batch))(model)
        opt.update(model, grads)
        return loss

    for i in range(3):
        step(model, opt, jax.device_put(family.batch(i), zpp.batch_sharding(mesh24)))
    assert len(traces) == (1 if placed else 2)


def test_weights_are_decoded_and_gradients_quantized_in_the_compute_dtype(mesh24):
    """With a bf16 compute dtype over fp32 parameters, every unit's weight
    dequantization writes bf16 (not fp32 weights that a cast then copies)
    and every gradient the quantizer reads is bf16 (not an fp32 copy of
    it): the step reads and writes half the bytes of both there."""
    import re

    from zpp_jax.models import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny", seq_len=16, dtype="bfloat16"), nnx.Rngs(0))
    config = zpp.ZeroPPConfig(comm_dtype="bfloat16")
    trainer = zpp.Trainer(model, optax.adamw(1e-3), mesh24, config, compute_dtype="bfloat16")
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    text = (
        trainer.train_step.trace(trainer.abstract_state(), batch).lower().as_text(debug_info=True)
    )
    scope = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', text, re.M))

    def calls(kernel, where):
        """(operand types, result types) of the calls of `kernel` in scope `where`."""
        pattern = rf"func\.call @_{kernel}(?:_\d+)?\(.* : \((.*)\) -> (.*) loc\((#loc\d+)\)"
        found = [m.groups() for m in re.finditer(pattern, text)]
        return [(a, r) for a, r, loc in found if scope.get(loc, "").startswith(where)]

    decoded = calls("dequantize", "zpp_gather")
    assert decoded and all(r.endswith("bf16>") for _, r in decoded), decoded
    # The gradient's blocks: (devices, blocks, block); the weights' are 1-D.
    gradients = [a for a, _ in calls("quantize", "zpp_quantize") if a.split(",")[0].count("x") == 3]
    assert gradients and all(a.split(",")[0].endswith("bf16>") for a in gradients), gradients


class _DropoutBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.gelu(self.lin(x)))


class _SplitKeyStack(nnx.Module):
    """Layers made by `nnx.vmap` with their random keys split per layer
    (`nnx.split_rngs`), run by `nnx.scan`: a key array, one key a layer."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _DropoutBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, block):
            return block(x)

        return self.head(step(x, self.blocks))


def test_a_unit_holding_keys_split_per_layer_equals_one_device():
    """A unit whose layers carry one random key each (a key array): each
    key is folded with the device index, and without dropout (eval) the
    gradients are one device's to fp32 round-off; with dropout it trains."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    plain = _SplitKeyStack(nnx.Rngs(0, dropout=1))
    plain.eval()
    want = dict(nnx.to_flat_state(nnx.grad(loss)(plain, x)))
    mesh = zpp.make_mesh(2, 4)
    whole = zpp.shard(
        _SplitKeyStack(nnx.Rngs(0, dropout=1)),
        mesh,
        zpp.ZeroPPConfig.zero3(comm_dtype=None),
        policy=lambda path, module: isinstance(module, _SplitKeyStack),
    )
    whole.eval()
    rows = jax.device_put(x, zpp.batch_sharding(mesh))
    got = dict(nnx.to_flat_state(nnx.jit(nnx.grad(loss))(whole, rows)))
    for key, value in want.items():
        np.testing.assert_allclose(got[key].get_value(), value.get_value(), rtol=0, atol=1e-6)
    whole.train()
    assert np.isfinite(float(nnx.jit(loss)(whole, rows)))


class _LayerWithSharedEmbed(nnx.Module):
    def __init__(self, embed, rngs):
        self.embed = embed  # the model's own embedding, shared
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x, tokens):
        return self.lin(x) + self.embed(tokens)


class _SharedEmbedModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.layer = _LayerWithSharedEmbed(self.embed, rngs)

    def __call__(self, tokens):
        return self.layer(self.embed(tokens), tokens).sum(-1)


def test_a_unit_called_inside_another_is_refused_and_the_fix_is_exact():
    """The default units make the shared embedding a unit that the layer's
    unit calls: refused, naming the nesting and the fix. The fix (the
    layer alone a unit) gives one device's gradients."""
    mesh = zpp.make_mesh(2, 4)
    tokens = jnp.arange(16).reshape(8, 2) % 32
    rows = jax.device_put(tokens, zpp.batch_sharding(mesh))

    def loss(model, tokens):
        return jnp.mean(model(tokens) ** 2)

    exact = zpp.ZeroPPConfig.zero3(comm_dtype=None)
    nested = zpp.shard(_SharedEmbedModel(nnx.Rngs(0)), mesh, exact)
    with pytest.raises(zpp.UsageError, match="unit embed is called inside another unit's call"):
        nnx.jit(loss)(nested, rows)
    fixed = zpp.shard(
        _SharedEmbedModel(nnx.Rngs(0)),
        mesh,
        exact,
        policy=lambda path, module: isinstance(module, _LayerWithSharedEmbed),
    )
    got = dict(nnx.to_flat_state(nnx.jit(nnx.grad(loss))(fixed, rows)))
    want = dict(nnx.to_flat_state(nnx.grad(loss)(_SharedEmbedModel(nnx.Rngs(0)), tokens)))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key].get_value(), value.get_value(), rtol=0, atol=1e-6)
