"""A unit's code that reduces over its batch's rows without combining the
result over the devices is refused (`zpp_jax.rows`); what combines it
(`nnx.BatchNorm`, Linen's `nn.BatchNorm`) or never mixes rows is not."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zpp_jax as zpp
from zpp_jax.rows import mixed_rows

EXACT = zpp.ZeroPPConfig.zero3(comm_dtype=None)


class OwnBatchNorm(nnx.Module):
    """A batch norm of one's own, as third-party libraries carry them."""

    def __init__(self, n):
        self.scale = nnx.Param(jnp.ones(n))
        self.mean = nnx.BatchStat(jnp.zeros(n))

    def __call__(self, x):
        mean = x.mean(0)
        self.mean.value = 0.9 * self.mean.value + 0.1 * mean
        return (x - mean) / jnp.sqrt(x.var(0) + 1e-5) * self.scale


class Net(nnx.Module):
    def __init__(self, norm, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.norm = norm
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.lin(x))))


class Centered(nnx.Module):
    """A linear layer whose output is centred over the batch."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        y = self.lin(x)
        return y - y.mean(axis=0, keepdims=True)


class LinenOwnNorm(nn.Module):
    """flaxmodels' ResNet pattern: a Linen batch norm of its own, with no
    axis name, its statistics in `batch_stats`."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        mean = self.variable("batch_stats", "mean", jnp.zeros, (x.shape[-1],))
        batch_mean = x.mean(0)
        if train and not self.is_initializing():
            mean.value = 0.9 * mean.value + 0.1 * batch_mean
        return (x - batch_mean) * scale


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(2)(LinenOwnNorm()(nn.Dense(8)(x), train))


class Holder(nnx.Module):
    """`Centered` as a child: a unit of its own."""

    def __init__(self, rngs):
        self.block = Centered(rngs)

    def __call__(self, x):
        return self.block(x)


def _rows(mesh):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)
    return x, jax.device_put(x, zpp.batch_sharding(mesh))


@pytest.mark.parametrize(
    "make", [lambda r: Net(OwnBatchNorm(8), r), Holder], ids=["norm", "centred"]
)
def test_a_reduction_over_the_rows_is_refused_naming_the_unit(make):
    mesh = zpp.make_mesh(2, 4)
    model = zpp.shard(make(nnx.Rngs(0)), mesh, EXACT)
    _, rows = _rows(mesh)
    with pytest.raises(zpp.UsageError, match=r"reduces over the rows of its batch \(reduce_sum"):
        nnx.jit(lambda m, x: m(x).sum())(model, rows)


def test_a_linen_batch_norm_of_its_own_is_refused():
    mesh = zpp.make_mesh(2, 4)
    x, rows = _rows(mesh)
    module = LinenNet()
    variables = module.init(jax.random.key(0), x)
    model, sharded = zpp.shard_linen(module, variables, mesh, EXACT)
    with pytest.raises(zpp.UsageError, match="reduces over the rows of its batch"):
        jax.jit(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))(sharded, rows)


def test_nnx_batch_norm_is_combined_over_the_devices_and_equals_one_device():
    mesh = zpp.make_mesh(2, 4)
    x, rows = _rows(mesh)

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    want = dict(
        nnx.to_flat_state(nnx.grad(loss)(Net(nnx.BatchNorm(8, rngs=nnx.Rngs(1)), nnx.Rngs(0)), x))
    )
    model = zpp.shard(Net(nnx.BatchNorm(8, rngs=nnx.Rngs(1)), nnx.Rngs(0)), mesh, EXACT)
    got = dict(nnx.to_flat_state(nnx.jit(nnx.grad(loss))(model, rows)))
    for key, value in want.items():
        np.testing.assert_allclose(got[key].get_value(), value.get_value(), rtol=0, atol=1e-6)


def test_the_walk_follows_the_batch_axis_and_a_combining_collective():
    """On plain jaxprs: a reduction over another axis mixes nothing; over
    the batch axis (moved by a transpose, or contracted by a matrix
    product) it does; a psum over the devices clears it."""

    def walk(f, *shapes):
        closed = jax.make_jaxpr(f)(*[jnp.ones(s) for s in shapes])
        return [m is not None for m in mixed_rows(closed, [True] * len(shapes), ("node",))]

    assert walk(lambda x: x.sum(1), (4, 3)) == [False]
    assert walk(lambda x: x.sum(0), (4, 3)) == [True]
    assert walk(lambda x: x.T.sum(1), (4, 3)) == [True]
    assert walk(lambda x: x.T @ x, (4, 3)) == [True]
    assert walk(lambda x: x @ x.T, (4, 3)) == [False]
    assert walk(lambda x: jnp.cumsum(x.reshape(4, 3, 1), axis=1), (4, 3)) == [False]
    combined = jax.make_jaxpr(lambda x: jax.lax.psum(x.sum(0), "node"), axis_env=[("node", 2)])(
        jnp.ones((4, 3))
    )
    assert mixed_rows(combined, [True], ("node",)) == [None]
