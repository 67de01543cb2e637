"""Flax models as their authors wrote them, one pattern per test: each runs
sharded exactly as on one device (loss per step to 1e-5 relative, step-1
gradients to 1e-4 per leaf, in the exact mode), or is refused with a
`UsageError` that says what to do. `docs/guide/adoption.md` lists these
tests; `tests/test_docs.py` checks that it names each one."""

import dataclasses
import enum

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_shard import EXACT, FULL, _norm_rel, optimizer
from test_shard_convergence import GAP, STEPS

import zpp_jax as zpp
from zpp_jax.errors import UsageError

ROWS, D = 16, 16  # 2 rows per device on 2 x 4


def _batch(i: int) -> dict:
    rng = np.random.default_rng(100 + i)
    x = rng.standard_normal((ROWS, D)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, ::-1] * 1.5)}


def _assert_close(losses, want, grads, want_grads):
    """Losses within 1e-5 relative per step; step-1 gradients within 1e-4
    per leaf."""
    for a, b in zip(losses, want, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, want)
    flat, ref = jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(want_grads)
    assert [p for p, _ in flat] == [p for p, _ in ref]
    for (path, g), (_, r) in zip(flat, ref, strict=True):
        assert _norm_rel(g, r) <= 1e-4, jax.tree_util.keystr(path)


# -- NNX: the loop every pattern below trains with ------------------------------


def nnx_train(model, loss, steps: int, mesh=None, tx=None):
    """`tx` (default AdamW) on `loss(model, batch)`: the losses and the
    step-1 gradients."""
    optimizer = nnx.Optimizer(model, tx or optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value, grads

    losses, first = [], None
    for i in range(steps):
        batch = _batch(i)
        if mesh is not None:
            batch = jax.device_put(batch, zpp.batch_sharding(mesh))
        value, grads = step(model, optimizer, batch)
        losses.append(float(value))
        first = first if first is not None else jax.tree.map(np.asarray, nnx.to_pure_dict(grads))
    return losses, first


def nnx_exact(make, loss, mesh, steps: int = 5, **shard_kwargs):
    want, want_grads = nnx_train(make(), loss, steps)
    model = zpp.shard(make(), mesh, EXACT, **shard_kwargs)
    losses, grads = nnx_train(model, loss, steps, mesh)
    _assert_close(losses, want, grads, want_grads)
    return model


# -- unit arguments and results: any pytree ------------------------------------


class Act(enum.Enum):
    RELU = "relu"
    TANH = "tanh"


@dataclasses.dataclass
class Extras:
    """A plain dataclass (not a registered pytree) passed to a unit."""

    scale: jax.Array  # one per row of the batch
    act: Act
    label: str = "block"


class PytreeBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x, extras: Extras, opts: dict, skip=None):
        h = self.lin(x) * extras.scale[:, None]
        h = nnx.relu(h) if extras.act is Act.RELU else jnp.tanh(h)
        h = h if skip is None else h + skip
        return h, {"doubled": [h * 2, None], "layers": opts["layers"], "label": extras.label}


class PytreeNet(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([PytreeBlock(rngs) for _ in range(2)])

    def __call__(self, x):
        scale = 1 + 0.1 * jnp.arange(x.shape[0], dtype=x.dtype)
        skip = None
        for i, block in enumerate(self.blocks):
            extras = Extras(scale, Act.RELU if i else Act.TANH)
            out, aux = block(x, extras, {"layers": 2, "flag": True}, skip=skip)
            assert aux["layers"] == 2 and aux["label"] == "block" and aux["doubled"][1] is None
            x, skip = out, aux["doubled"][0] / 2
        return x


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_unit_arguments_and_results_are_any_pytree(mesh24):
    """Dataclass, enum, string, dict, list, None and keyword arguments in;
    a tuple of an array and a dict of lists, None, ints and strings out."""
    nnx_exact(lambda: PytreeNet(nnx.Rngs(0)), _mse, mesh24)


class Hidden:
    """An object holding an array that is no pytree."""

    def __init__(self, value):
        self.value = value


class HiddenBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x, hidden: Hidden):
        return self.lin(x) * hidden.value


def test_an_object_hiding_arrays_from_the_unit_is_refused(mesh24):
    model = zpp.shard(HiddenBlock(nnx.Rngs(0)), mesh24, EXACT, policy=[()])
    x = jax.device_put(np.ones((ROWS, D), np.float32), zpp.batch_sharding(mesh24))
    hides = r"<the model>'s positional argument 1 is a Hidden holding arrays"
    with pytest.raises(UsageError, match=hides):
        model(x, Hidden(jnp.ones(D)))


# -- a module that writes into a container it is passed ------------------------


class ActBlock(nn.Module):
    """As flaxmodels' ResNet blocks do: activations written into a dict
    passed down the call."""

    @nn.compact
    def __call__(self, x, act: dict, name: str):
        x = nn.tanh(nn.Dense(D)(x))
        act[name] = x
        return x


class ActNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        act = {}
        for i in range(3):
            x = ActBlock(name=f"block_{i}")(x, act, f"block_{i}")
        return nn.Dense(D, name="head")(x), act


def _act_loss(out, batch):
    y, act = out
    assert sorted(act) == ["block_0", "block_1", "block_2"]
    return jnp.mean((y - batch["y"]) ** 2) + 0.1 * jnp.mean(act["block_1"] ** 2)


def linen_train(module, variables, loss, steps: int, mesh=None, apply=None, tx=None):
    """`tx` (default AdamW) on `loss(module output, batch)` over
    ``variables['params']``."""
    apply, tx = apply or module.apply, tx or optax.adamw(1e-2)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(
            lambda p: loss(apply({"params": p, **rest}, batch["x"]), batch)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    losses, first = [], None
    for i in range(steps):
        batch = _batch(i)
        if mesh is not None:
            batch = jax.device_put(batch, zpp.batch_sharding(mesh))
        params, opt_state, value, grads = step(params, opt_state, batch)
        losses.append(float(value))
        first = first if first is not None else jax.tree.map(np.asarray, grads)
    return losses, first


def test_writes_into_a_dict_argument_reach_the_caller(mesh24):
    module = ActNet()
    variables = module.init(jax.random.key(0), jnp.zeros((1, D)))
    want, want_grads = linen_train(module, variables, _act_loss, 5)
    model, sharded = zpp.shard_linen(module, variables, mesh24, EXACT)
    assert set(model.units) == {("block_0",), ("block_1",), ("block_2",), ("head",)}
    losses, grads = linen_train(module, sharded, _act_loss, 5, mesh24, model.apply)
    _assert_close(losses, want, grads, want_grads)


class NormActBlock(nn.Module):
    """flaxmodels' ResNet block pattern with Linen's own BatchNorm (no axis
    name): its activation written into a dict passed down the call."""

    @nn.compact
    def __call__(self, x, act: dict, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(D)(x))
        act[self.name] = x
        return nn.relu(x)


class NormActNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        act = {}
        for i in range(2):
            x = NormActBlock(name=f"block_{i}")(x, act, train)
        act["head"] = nn.Dense(D, name="head")(x)
        return act


def test_a_batch_norm_without_an_axis_name_with_dict_writes_equals_one_device(mesh24):
    """Each block a unit that normalises over its batch and writes its
    activation into the caller's dict: the activations, the gradients and
    the updated running statistics equal one device's."""
    x = _batch(0)["x"]
    module = NormActNet()
    variables = module.init(jax.random.key(0), x)

    def loss(variables, x, apply):
        act, updates = apply(variables, x, mutable=["batch_stats"])
        assert sorted(act) == ["block_0", "block_1", "head"]
        return jnp.mean(act["head"] ** 2) + 0.1 * jnp.mean(act["block_0"] ** 2), updates

    step = jax.jit(jax.grad(loss, has_aux=True), static_argnums=2)
    want = step(variables, x, module.apply)
    model, sharded = zpp.shard_linen(module, variables, mesh24, EXACT)
    got = step(sharded, jax.device_put(x, zpp.batch_sharding(mesh24)), model.apply)
    flat_want, flat_got = jax.tree.leaves_with_path(want), jax.tree.leaves(got)
    # 14 gradients (the running statistics' among them, zero) and 4 statistics
    assert len(flat_want) == len(flat_got) == 18
    for (path, w), g in zip(flat_want, flat_got, strict=True):
        err = jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6, err_msg=err)


class NestedWriter(nn.Module):
    @nn.compact
    def __call__(self, x, act: dict):
        act["inner"] = {"seen": x}  # a container the caller does not hold
        return nn.Dense(D)(x)


class CountingBlock(nn.Module):
    @nn.compact
    def __call__(self, x, seen: dict):
        seen["calls"] = seen.get("calls", 0) + 1  # a Python int: fixed when traced
        return nn.Dense(D)(x)


class CallsWithADict(nn.Module):
    """A model whose one child, `block` (named "child"), is given a new dict."""

    block: type

    @nn.compact
    def __call__(self, x):
        return self.block(name="child")(x, {})


def _apply_sharded_linen(module, mesh):
    variables = module.init(jax.random.key(0), jnp.zeros((1, D)))
    model, sharded = zpp.shard_linen(module, variables, mesh, EXACT)
    x = jax.device_put(np.ones((ROWS, D), np.float32), zpp.batch_sharding(mesh))
    return model.apply(sharded, x)


def test_a_write_the_caller_cannot_hold_is_refused_naming_it(mesh24):
    with pytest.raises(UsageError, match=r"unit child wrote positional argument 1\['inner'\]"):
        _apply_sharded_linen(CallsWithADict(NestedWriter), mesh24)


def test_a_non_array_write_into_an_argument_is_refused(mesh24):
    with pytest.raises(UsageError, match=r"unit child wrote a value that is not an array"):
        _apply_sharded_linen(CallsWithADict(CountingBlock), mesh24)


# -- a batch axis named in the model, as pmap-era models name it ----------------


class SyncBlock(nnx.Module):
    """BatchNorm over a named axis, and a batch mean reduced by hand over
    it (SyncBN-style code); with no name, what one device computes."""

    def __init__(self, axis_name, rngs):
        self.lin = nnx.Linear(D, D, use_bias=False, rngs=rngs)  # a bias BatchNorm cancels
        self.norm = nnx.BatchNorm(D, axis_name=axis_name, momentum=0.9, rngs=rngs)
        self.axis_name = axis_name

    def __call__(self, x):
        h = self.norm(self.lin(x))
        centre = jnp.mean(h, axis=0, keepdims=True)
        if self.axis_name is not None:
            centre = jax.lax.pmean(centre, self.axis_name)
        return jnp.tanh(h - 0.5 * centre)


class SyncNet(nnx.Module):
    def __init__(self, axis_name, rngs):
        self.blocks = nnx.List([SyncBlock(axis_name, rngs) for _ in range(2)])
        self.head = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_named_batch_axis_is_bound_to_every_device(mesh24):
    """BatchNorm(axis_name='batch') and lax.pmean over 'batch', bound by
    batch_axis_name: as one device on the global batch, running statistics
    to 1e-5 (fp32 round-off of two reduction orders over five steps: 1e-7 to
    1.2e-6, by CPU)."""
    want, want_grads = nnx_train(SyncNet(None, nnx.Rngs(0)), _mse, 5)
    reference = SyncNet(None, nnx.Rngs(0))
    nnx_train(reference, _mse, 5)
    model = zpp.shard(SyncNet("batch", nnx.Rngs(0)), mesh24, EXACT, batch_axis_name="batch")
    losses, grads = nnx_train(model, _mse, 5, mesh24)
    _assert_close(losses, want, grads, want_grads)
    stats, ref = nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat)
    pairs = zip(jax.tree.leaves(stats), jax.tree.leaves(ref), strict=True)
    assert all(_norm_rel(a, b) <= 1e-5 for a, b in pairs)
    assert len(jax.tree.leaves(ref)) == 4  # mean and var of two BatchNorms


def test_an_unbound_batch_axis_is_refused_naming_it(mesh24):
    model = zpp.shard(SyncNet("batch", nnx.Rngs(0)), mesh24, EXACT)
    x = jax.device_put(np.ones((ROWS, D), np.float32), zpp.batch_sharding(mesh24))
    with pytest.raises(UsageError, match=r"axis name 'batch'.*batch_axis_name='batch'"):
        model(x)
    with pytest.raises(UsageError, match="one of the mesh's own axes"):
        zpp.shard(SyncNet(None, nnx.Rngs(0)), mesh24, EXACT, batch_axis_name="node")


class LinenSyncBlock(nn.Module):
    """As Flax's ImageNet ResNet writes its norms."""

    axis_name: str | None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(D, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.tanh(x)


class LinenSyncNet(nn.Module):
    axis_name: str | None

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = LinenSyncBlock(self.axis_name, name=f"block_{i}")(x)
        return nn.Dense(D, name="head")(x)


def linen_stats_train(module, variables, steps, mesh=None, apply=None, tx=None):
    """`linen_train` with the batch statistics updated each step."""
    apply, tx = apply or module.apply, tx or optax.adamw(1e-2)
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, stats, opt_state, batch):
        def objective(params):
            out, new = apply(
                {"params": params, "batch_stats": stats}, batch["x"], mutable=["batch_stats"]
            )
            return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]

        (value, stats), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value, grads

    losses, first = [], None
    for i in range(steps):
        batch = _batch(i)
        if mesh is not None:
            batch = jax.device_put(batch, zpp.batch_sharding(mesh))
        params, stats, opt_state, value, grads = step(params, stats, opt_state, batch)
        losses.append(float(value))
        first = first if first is not None else jax.tree.map(np.asarray, grads)
    return losses, first, stats


def test_linen_batchnorm_over_a_named_axis_is_bound(mesh24):
    plain = LinenSyncNet(None)
    variables = plain.init(jax.random.key(0), jnp.zeros((2, D)))
    want, want_grads, want_stats = linen_stats_train(plain, variables, 5)
    named = LinenSyncNet("batch")
    model, sharded = zpp.shard_linen(named, variables, mesh24, EXACT, batch_axis_name="batch")
    losses, grads, stats = linen_stats_train(named, sharded, 5, mesh24, model.apply)
    _assert_close(losses, want, grads, want_grads)
    pairs = zip(jax.tree.leaves(stats), jax.tree.leaves(want_stats), strict=True)
    assert all(_norm_rel(a, b) <= 1e-5 for a, b in pairs)
    unbound, sharded = zpp.shard_linen(named, variables, mesh24, EXACT)
    with pytest.raises(UsageError, match=r"axis name 'batch'.*batch_axis_name='batch'"):
        linen_stats_train(named, sharded, 1, mesh24, unbound.apply)


# -- partitioning metadata --------------------------------------------------------------

# MaxText-style rules: parameters' "embed" over the FSDP axis, activations'
# batch over zpp's devices (a constraint zpp honours outside units, drops inside).
RULES = (
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("activation_batch", ("node", "local")),
    ("activation_embed", None),
    ("activation_mlp", None),
)


def _part(*names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class BoxedBlock(nn.Module):
    """As Flax's lm1b writes its layers: logically partitioned parameters,
    logical constraints on activations."""

    @nn.compact
    def __call__(self, x):
        bias = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",))
        h = nn.Dense(2 * D, kernel_init=_part("embed", "mlp"), bias_init=bias)(x)
        h = nn.with_logical_constraint(nn.tanh(h), ("activation_batch", "activation_mlp"))
        return x + nn.Dense(D, kernel_init=_part("mlp", "embed"))(h)


class BoxedNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = BoxedBlock(name=f"block_{i}")(x)
            x = nn.with_logical_constraint(x, ("activation_batch", "activation_embed"))
        return nn.Dense(D, kernel_init=_part("embed", "vocab"), name="head")(x)


def _boxed_loss(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


def test_a_boxed_linen_model_with_logical_names_trains_exactly_and_keeps_its_boxes(
    mesh24, tmp_path
):
    """Boxes in, the same boxes out (shard, unshard, checkpoint); the split
    dimension follows the rules; activation constraints kept (outside units,
    under the mesh) and dropped (inside)."""
    module = BoxedNet()
    with nn.logical_axis_rules(RULES):
        variables = module.init(jax.random.key(0), jnp.zeros((2, D)))
        want, want_grads = linen_train(module, variables, _boxed_loss, 5)
        model, sharded = zpp.shard_linen(module, variables, mesh24, EXACT)
        with jax.set_mesh(mesh24):
            losses, grads = linen_train(module, sharded, _boxed_loss, 5, mesh24, model.apply)
    _assert_close(losses, want, grads, want_grads)
    spec = nn.get_partition_spec(variables)
    assert spec["params"]["block_0"]["Dense_1"]["kernel"] == jax.sharding.PartitionSpec(
        "mlp", "embed"
    )
    assert nn.get_partition_spec(sharded) == spec
    # "embed" maps to the FSDP axis: the second dimension of ("mlp", "embed").
    stored = sharded["params"]["block_0"]["Dense_1"]["kernel"].value.sharding.spec
    assert stored == jax.sharding.PartitionSpec(None, ("node", "local"))
    plain, whole = zpp.unshard_linen(model, sharded)
    assert plain is module and nn.get_partition_spec(whole) == spec
    kernel = whole["params"]["block_0"]["Dense_1"]["kernel"].value
    assert kernel.sharding.is_fully_replicated
    saver = zpp.Checkpointer(tmp_path / "ckpt")
    saver.save(1, sharded)
    restored, _ = saver.restore(sharded)
    assert nn.get_partition_spec(restored) == spec
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(sharded), strict=True):
        assert a.sharding == b.sharding and np.array_equal(a, b)


class ConstrainedBlock(nnx.Module):
    def __init__(self, rngs, spec, constrain=None):
        self.lin, self.spec, self.constrain = nnx.Linear(D, D, rngs=rngs), spec, constrain

    def __call__(self, x):
        constrain = self.constrain or jax.lax.with_sharding_constraint  # looked up when called
        return constrain(self.lin(x), self.spec)


def test_a_sharding_constraint_inside_a_unit_is_mapped_onto_the_mesh(mesh24):
    """A constraint over the data axes (zpp's own, or FSDP's `data`) holds
    inside a unit by construction: the output is the plain model's. An
    axis the mesh does not reach, or a sharding that names none, is refused."""
    P = jax.sharding.PartitionSpec
    x = np.random.default_rng(0).normal(size=(ROWS, D)).astype(np.float32)
    want = ConstrainedBlock(nnx.Rngs(0), None).lin(x)
    placed = jax.device_put(x, zpp.batch_sharding(mesh24))
    for spec in (P(("node", "local")), P("data", None), P(("data", "fsdp"))):
        model = zpp.shard(ConstrainedBlock(nnx.Rngs(0), spec), mesh24, EXACT, policy=[()])
        np.testing.assert_allclose(model(placed), want, rtol=1e-6, atol=1e-6)
    wrong = {
        P("batch"): "along the mesh axis 'batch', which zpp's mesh",
        jax.sharding.make_single_device_sharding(jax.devices()[0]): "to a SingleDeviceSharding",
    }
    for spec, message in wrong.items():
        model = zpp.shard(ConstrainedBlock(nnx.Rngs(0), spec), mesh24, EXACT, policy=[()])
        with pytest.raises(UsageError, match=f"unit <the model> constrains an array {message}"):
            model(placed)
    # Bound before the call, as `from jax.lax import with_sharding_constraint` binds it.
    block = ConstrainedBlock(nnx.Rngs(0), P("data"), jax.lax.with_sharding_constraint)
    model = zpp.shard(block, mesh24, EXACT, policy=[()])
    with pytest.raises(UsageError, match="in a way zpp cannot map onto its mesh .* imported"):
        model(placed)


class PartitionedNet(nnx.Module):
    """NNX parameters with sharding names, created under the user's mesh."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        wide, tall = (
            nnx.with_partitioning(init, (None, "fsdp")),
            nnx.with_partitioning(init, ("fsdp", None)),
        )
        self.up = nnx.List([nnx.Linear(d, 2 * D, kernel_init=wide, rngs=rngs) for d in (D, 2 * D)])
        self.down = nnx.Linear(2 * D, D, kernel_init=tall, rngs=rngs)

    def __call__(self, x):
        for layer in self.up:
            x = jnp.tanh(layer(x))
        return self.down(x)


def test_nnx_sharding_names_choose_the_split_and_come_back_on_unshard(mesh24, tmp_path):
    user_mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

    def make():
        with jax.set_mesh(user_mesh):
            return PartitionedNet(nnx.Rngs(0))

    with jax.set_mesh(user_mesh):
        want, want_grads = nnx_train(make(), _mse, 5)
    original = make()
    names = nnx.get_partition_spec(nnx.state(original, nnx.Param))
    model = zpp.shard(make(), mesh24, EXACT)
    # (None, "fsdp"): the second dimension, which the default would not pick.
    assert model.up[0].kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(
        None, ("node", "local")
    )
    assert model.up[0].kernel.get_metadata("out_sharding") == (None, ("node", "local"))
    losses, grads = nnx_train(model, _mse, 5, mesh24)
    _assert_close(losses, want, grads, want_grads)
    stored = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    saver = zpp.Checkpointer(tmp_path / "ckpt")
    saver.save(5, nnx.state(model, nnx.Param))
    restored, _ = saver.restore(nnx.state(model, nnx.Param))
    assert nnx.get_partition_spec(restored) == stored
    plain = zpp.unshard(model)
    assert nnx.get_partition_spec(nnx.state(plain, nnx.Param)) == names


# -- Linen decoding state: the cache collection -----------------------------------------

VOCAB, PROMPT, NEW = 32, 4, 6


class DecoderBlock(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x):
        mask = None if self.decode else nn.make_causal_mask(jnp.ones(x.shape[:2]))
        attend = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D, decode=self.decode)
        x = x + attend(nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))


class TinyLM(nn.Module):
    """A decoder whose attention keeps Linen's autoregressive ``cache``
    collection when ``decode`` (as lm1b's does)."""

    decode: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        for i in range(2):
            x = DecoderBlock(self.decode, name=f"block_{i}")(x)
        return nn.Dense(VOCAB, name="head")(x)


def greedy(apply, variables, cache, prompt):
    """Feed the prompt a token at a time, then NEW greedy tokens."""
    step = jax.jit(lambda variables, token: apply(variables, token, mutable=["cache"]))
    tokens, token = [], prompt[:, :1]
    for t in range(PROMPT + NEW - 1):
        logits, changed = step({**variables, "cache": cache}, token)
        cache = changed["cache"]
        token = prompt[:, t + 1 : t + 2] if t + 1 < PROMPT else jnp.argmax(logits[:, -1:], -1)
        tokens.append(np.asarray(token))
    return np.concatenate(tokens, axis=1)


@pytest.mark.slow  # a decoding loop; the NNX caches split with the batch in the loop (test_shard)
def test_linen_greedy_decoding_with_a_cache_gives_one_devices_tokens(mesh24):
    """The cache's batch rows are split with the batch: every token equals
    one device's."""
    prompt = np.random.default_rng(0).integers(0, VOCAB, (ROWS, PROMPT)).astype(np.int32)
    params = TinyLM().init(jax.random.key(0), jnp.zeros((1, PROMPT), jnp.int32))["params"]
    decoder = TinyLM(decode=True)
    empty = jnp.zeros((ROWS, PROMPT + NEW), jnp.int32)
    cache = decoder.init(jax.random.key(0), empty)["cache"]
    want = greedy(decoder.apply, {"params": params}, cache, prompt)
    model, sharded = zpp.shard_linen(decoder, {"params": params}, mesh24, EXACT)
    placed = jax.device_put(prompt, zpp.batch_sharding(mesh24))
    got = greedy(model.apply, sharded, zpp.on_mesh(cache, mesh24), placed)
    assert got.shape == (ROWS, PROMPT + NEW - 1)
    assert len(set(want[:, PROMPT - 1 :].ravel().tolist())) > 1  # not one token throughout
    np.testing.assert_array_equal(got, want)


# -- every pattern that trains, with ZeRO++ on ---------------------------------------------
# Each gives its losses on one device (config None: the exact mode equals
# it, as the tests above show) or sharded with `config`.


def _pytree_losses(config, mesh, steps, tx):
    model = PytreeNet(nnx.Rngs(0))
    if config is None:
        return nnx_train(model, _mse, steps, tx=tx)[0]
    return nnx_train(zpp.shard(model, mesh, config), _mse, steps, mesh, tx)[0]


def _linen_losses(module, variables, loss, config, mesh, steps, tx):
    if config is None:
        return linen_train(module, variables, loss, steps, tx=tx)[0]
    model, sharded = zpp.shard_linen(module, variables, mesh, config)
    return linen_train(module, sharded, loss, steps, mesh, model.apply, tx)[0]


def _writes_losses(config, mesh, steps, tx):
    variables = ActNet().init(jax.random.key(0), jnp.zeros((1, D)))
    return _linen_losses(ActNet(), variables, _act_loss, config, mesh, steps, tx)


def _named_axis_losses(config, mesh, steps, tx):
    if config is None:
        return nnx_train(SyncNet(None, nnx.Rngs(0)), _mse, steps, tx=tx)[0]
    model = zpp.shard(SyncNet("batch", nnx.Rngs(0)), mesh, config, batch_axis_name="batch")
    return nnx_train(model, _mse, steps, mesh, tx)[0]


def _linen_named_axis_losses(config, mesh, steps, tx):
    variables = LinenSyncNet(None).init(jax.random.key(0), jnp.zeros((2, D)))
    if config is None:
        return linen_stats_train(LinenSyncNet(None), variables, steps, tx=tx)[0]
    module = LinenSyncNet("batch")
    model, sharded = zpp.shard_linen(module, variables, mesh, config, batch_axis_name="batch")
    return linen_stats_train(module, sharded, steps, mesh, model.apply, tx)[0]


def _boxed_losses(config, mesh, steps, tx):
    module = BoxedNet()
    with nn.logical_axis_rules(RULES):
        variables = module.init(jax.random.key(0), jnp.zeros((2, D)))
        return _linen_losses(module, variables, _boxed_loss, config, mesh, steps, tx)


def _named_nnx_losses(config, mesh, steps, tx):
    user_mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(user_mesh):
        made = PartitionedNet(nnx.Rngs(0))
        if config is None:
            return nnx_train(made, _mse, steps, tx=tx)[0]
    return nnx_train(zpp.shard(made, mesh, config), _mse, steps, mesh, tx)[0]


TRAINING_PATTERNS = {
    "pytree_arguments": _pytree_losses,
    "dict_writes": _writes_losses,
    "named_batch_axis": _named_axis_losses,
    "linen_named_batch_axis": _linen_named_axis_losses,
    "boxed_linen": _boxed_losses,
    "nnx_sharding_names": _named_nnx_losses,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINING_PATTERNS)
def test_every_pattern_trains_with_zeropp_like_zero3(name, mesh24):
    """qwZ, hpZ and qgZ at their defaults: the loss after STEPS within GAP
    of ZeRO-3's, with the optimizer the README's bound was measured with
    (ZeRO-3 in the exact mode is one device's, as the tests above hold it)."""
    zero3 = TRAINING_PATTERNS[name](None, mesh24, STEPS, optimizer())
    zeropp = TRAINING_PATTERNS[name](FULL, mesh24, STEPS, optimizer())
    assert np.mean(zero3[-5:]) < 0.95 * np.mean(zero3[:5])  # it learns (per batch: noisy)
    assert abs(zeropp[-1] - zero3[-1]) <= GAP * zero3[-1], (zeropp[-1], zero3[-1])
