"""`zpp.shard_linen` on Linen models written as users write them (a ViT,
a CNN with BatchNorm and dropout): the loop stays ``model.apply`` and
``jax.value_and_grad`` over ``variables["params"]``."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo
from test_shard import EXACT, _norm_rel, optimizer

import zpp_jax as zpp

FAMILIES = {f.name: f for f in zoo.linen_families()}
# ZeRO-3 exactness needs the same dropout masks as one device: none.
EXACT_MODELS = {"linen_vit": zoo.ViT(), "linen_cnn": zoo.CNN(dropout=0.0)}


def train(family, module, variables, steps, mesh=None, apply=None):
    """A user's Linen loop (BatchNorm statistics updated, dropout keyed by
    step). Returns the losses and the final variables."""
    apply = apply or module.apply
    tx = optimizer()
    params = variables["params"]
    stats = {k: v for k, v in variables.items() if k != "params"}
    opt_state = tx.init(params)
    if mesh is not None:
        stats, opt_state = zpp.on_mesh((stats, opt_state), mesh)
    mutable = list(stats)

    @jax.jit
    def step(params, stats, opt_state, batch, key):
        def loss_fn(params):
            kwargs = {"mutable": mutable} if mutable else {}
            out = apply(
                {"params": params, **stats}, batch["inputs"], rngs={"dropout": key}, **kwargs
            )
            logits, new = out if mutable else (out, {})
            return family.loss(logits, batch), new

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), {**stats, **new}, opt_state, loss

    losses = []
    for i in range(steps):
        batch = family.batch(i)
        if mesh is not None:
            batch = jax.device_put(batch, zpp.batch_sharding(mesh))
        params, stats, opt_state, loss = step(params, stats, opt_state, batch, jax.random.key(i))
        losses.append(float(loss))
    return losses, {"params": params, **stats}


@functools.cache
def _single_device(name, steps):
    module = EXACT_MODELS[name]
    _, variables = FAMILIES[name].make(0)
    return train(FAMILIES[name], module, variables, steps)


@functools.cache
def _null_gradients(name):
    """Parameters whose one-device gradient is zero up to rounding."""
    module = EXACT_MODELS[name]
    family = FAMILIES[name]
    _, variables = family.make(0)
    batch = family.batch(0)

    def loss(params):
        out = module.apply(
            {**variables, "params": params}, batch["inputs"], mutable=["batch_stats"]
        )
        return family.loss(out[0], batch)

    grads = _flat({"params": jax.grad(loss)(variables["params"])})
    total = np.sqrt(sum(float(np.sum(np.square(g))) for g in grads.values()))
    return {k for k, g in grads.items() if np.linalg.norm(g) <= 1e-6 * total}


def _flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


# The ViT's and the CNN's are the longest compilations of the file: in the slow set.
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("linen_vit", "linen_cnn") else n
        for n in FAMILIES
    ],
)
def test_zero3_equals_one_device(name, mesh24):
    """10 steps: losses to 1e-5; every parameter and BatchNorm statistic
    (those of the global batch) to 1e-5 per tensor; parameters keep their
    shapes."""
    ref_losses, ref = _single_device(name, 10)
    module = EXACT_MODELS[name]
    _, variables = FAMILIES[name].make(0)
    model, sharded = zpp.shard_linen(module, variables, mesh24, EXACT)
    assert jax.tree.map(np.shape, sharded) == jax.tree.map(np.shape, variables)
    losses, got = train(FAMILIES[name], module, sharded, 10, mesh24, model.apply)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-5
    want, initial, null = _flat(ref), _flat(variables), _null_gradients(name)
    for key, value in _flat(got).items():
        if key in null:
            # Zero gradient in exact arithmetic (an attention key bias: softmax
            # ignores a shift shared by a row). Adam moves it by its rounding
            # noise on both sides, at most the learning rate per step.
            assert np.max(np.abs(value - initial[key])) <= 10 * 1e-3, key
        else:
            assert _norm_rel(value, want[key]) <= 1e-5, key
    if name == "linen_cnn":
        assert any("batch_stats" in k for k in want)


def test_dropout_masks_per_device(mesh24):
    module, variables = FAMILIES["linen_cnn"].make(0)
    model, sharded = zpp.shard_linen(module, variables, mesh24, EXACT)
    x = jax.device_put(np.ones((16, 8, 8, 3), np.float32), zpp.batch_sharding(mesh24))

    @jax.jit
    def features(key):
        return model.apply(sharded, x, rngs={"dropout": key}, mutable=["batch_stats"])[0]

    a, b = np.asarray(features(jax.random.key(0))), np.asarray(features(jax.random.key(0)))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, np.asarray(features(jax.random.key(1))))


def test_bad_input_is_named(mesh24):
    module, variables = FAMILIES["linen_vit"].make(0)
    with pytest.raises(ValueError, match="selected no unit"):
        zpp.shard_linen(module, variables, mesh24, policy=lambda path: False)
    with pytest.raises(ValueError, match="units overlap: block_0 contains block_0/Dense_0"):
        zpp.shard_linen(module, variables, mesh24, policy=[("block_0",), ("block_0", "Dense_0")])
    model, ef = zpp.shard_linen(module, variables, mesh24, zpp.ZeroPPConfig(error_feedback=True))
    without = {c: v for c, v in ef.items() if c != "zpp_residuals"}
    x = FAMILIES["linen_vit"].batch(0)["inputs"]
    with pytest.raises(ValueError, match="no error-feedback residual: pass the 'zpp_residuals'"):
        model.apply(without, x, rngs={"dropout": jax.random.key(0)})
    with pytest.raises(ValueError, match="'params' collection"):
        zpp.shard_linen(module, {"batch_stats": {}}, mesh24)
    bad = {"params": {**variables["params"], "count": np.zeros((), np.int32)}}
    with pytest.raises(ValueError, match="count has dtype int32"):
        zpp.shard_linen(module, bad, mesh24)
    with pytest.raises(ValueError, match=r"already sharded \(zpp.shard_linen ran on it\)"):
        zpp.shard_linen(model, ef, mesh24)
    with pytest.raises(ValueError, match="gradient_block_size=65,536 is larger than the model's"):
        zpp.shard_linen(module, variables, mesh24, zpp.ZeroPPConfig(gradient_block_size=65536))


def test_error_feedback_residuals_carry_over(mesh24):
    """With error feedback each unit has a residual in the "zpp_residuals"
    collection; the loop differentiates the loss with respect to it too, and
    that gradient is the next step's residuals (the optimizer never sees it)."""
    family = FAMILIES["linen_cnn"]
    module, variables = family.make(0)
    config = zpp.ZeroPPConfig(error_feedback=True)
    model, sharded = zpp.shard_linen(module, variables, mesh24, config)
    params, residuals = sharded["params"], sharded["zpp_residuals"]
    stats = {c: v for c, v in sharded.items() if c not in ("params", "zpp_residuals")}
    assert len(jax.tree.leaves(residuals)) == len(model.units)
    assert all(float(jnp.max(jnp.abs(r))) == 0 for r in jax.tree.leaves(residuals))
    tx = optimizer()
    opt_state = zpp.on_mesh(tx.init(params), mesh24)
    stats = zpp.on_mesh(stats, mesh24)

    @jax.jit
    def step(params, residuals, stats, opt_state, batch, key):
        def loss_fn(params, residuals):
            variables = {"params": params, "zpp_residuals": residuals, **stats}
            out, new = model.apply(
                variables, batch["inputs"], rngs={"dropout": key}, mutable=list(stats)
            )
            return family.loss(out, batch), new

        (loss, new), (grads, residuals) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            params, residuals
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), residuals, {**stats, **new}, opt_state, loss

    losses = []
    for i in range(10):
        batch = jax.device_put(family.batch(i), zpp.batch_sharding(mesh24))
        params, residuals, stats, opt_state, loss = step(
            params, residuals, stats, opt_state, batch, jax.random.key(i)
        )
        losses.append(float(loss))
    assert all(float(jnp.max(jnp.abs(r))) > 0 for r in jax.tree.leaves(residuals))
    assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3])


# -- what units return and sow, and Linen's own transforms ---------------------------


class _SowingBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16)(x))
        self.sow("intermediates", "h", h)  # per example
        self.sow("intermediates", "mean_act", jnp.mean(jnp.abs(h)))  # over the batch
        return x + h


class _SowingNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = _SowingBlock(name=f"block_{i}")(x)
        return nn.Dense(4)(x)


def test_sown_values_and_outputs_inside_units(mesh24):
    """`sow` inside a Linen unit: per-example values come back as the
    global batch, a batch mean declared 'mean' as one device's, equal to
    the plain module's; undeclared, the mean raises, naming it."""
    x = np.random.default_rng(0).standard_normal((zoo.BATCH, 16)).astype(np.float32)
    module = _SowingNet()
    variables = module.init(jax.random.key(0), x)
    want, want_sown = module.apply(variables, x, mutable=["intermediates"])
    placed = jax.device_put(x, zpp.batch_sharding(mesh24))
    model, sharded = zpp.shard_linen(module, variables, mesh24, EXACT)
    apply = jax.jit(lambda m, v, x: m.apply(v, x, mutable=["intermediates"]), static_argnums=0)
    with pytest.raises(ValueError, match=r"unit block_0 returned sow\['intermediates/mean_act'\]"):
        apply(model, sharded, placed)
    model, sharded = zpp.shard_linen(module, variables, mesh24, EXACT, outputs="mean")
    got, got_sown = apply(model, sharded, placed)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert jax.tree.structure(got_sown) == jax.tree.structure(want_sown)
    for a, b in zip(jax.tree.leaves(got_sown), jax.tree.leaves(want_sown), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


class _Jitted(nn.Module):
    """`__call__` under `nn.jit`, as Google DeepMind's gemma library writes it."""

    @nn.jit
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = jnp.tanh(nn.Dense(16, name=f"layer_{i}")(x))
        return x


class _Rematted(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = jnp.tanh(nn.remat(nn.Dense)(16, name=f"layer_{i}")(x))
        return x


class _Cell(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(16)(x)), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan(name="stack")(x, None)[0]


@pytest.mark.slow  # two configs compiled per module
@pytest.mark.parametrize(
    "module", [_Jitted(), _Rematted(), _Scanned()], ids=["jit", "remat", "scan"]
)
def test_modules_under_linen_transforms_run_their_units(module, mesh24):
    """Under `nn.jit` (whose trace cache does not know the units), `nn.remat`
    and `nn.scan`, every trace runs the config the model was sharded with:
    after a plain call and a ZeRO-3 one in the same process, int4 weights
    give another loss; the ZeRO-3 loss and gradients equal the plain
    module's, traced or called eagerly."""
    x = np.random.default_rng(0).standard_normal((zoo.BATCH, 16)).astype(np.float32)
    variables = module.init(jax.random.key(0), x)

    def loss(apply, v, x):
        return jnp.sum(jnp.square(apply(v, x)))

    want, want_grads = jax.value_and_grad(functools.partial(loss, module.apply))(variables, x)
    placed = jax.device_put(x, zpp.batch_sharding(mesh24))
    losses = {}
    for name, config in (("exact", EXACT), ("int4", zpp.ZeroPPConfig(weight_bits=4))):
        model, sharded = zpp.shard_linen(module, variables, mesh24, config)
        step = jax.jit(jax.value_and_grad(functools.partial(loss, model.apply)))
        losses[name], grads = step(sharded, placed)
        if name == "exact":
            assert abs(losses[name] - want) <= 1e-6 * abs(want)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
                assert _norm_rel(a, b) <= 1e-6
            eager = model.apply(sharded, placed)
            np.testing.assert_allclose(eager, module.apply(variables, x), rtol=1e-6, atol=1e-6)
    assert abs(losses["int4"] - losses["exact"]) > 1e-4 * abs(losses["exact"])
