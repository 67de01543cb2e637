"""The token-sliced pipelined GPT against the unpipelined model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zpp_jax.models.gpt import GPT, GPTConfig, cross_entropy
from zpp_jax.pipeline import plan_tokens
from zpp_jax.pipeline.cost import AnalyticCost
from zpp_jax.pipeline.runtime import TokenPipeline

CFG = GPTConfig(seq_len=32, d_model=32, n_layers=4, n_heads=4, d_ff=64, dtype="float32")


def _stage_mesh(k):
    return jax.make_mesh(
        (k,), ("stage",), devices=jax.devices()[:k], axis_types=(jax.sharding.AxisType.Auto,)
    )


def _reference(batch, seed):
    model = GPT(CFG, nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 256, (batch, CFG.seq_len)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 256, (batch, CFG.seq_len)), jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return cross_entropy(nnx.merge(graphdef, params, rest)(tokens), targets)

    value, grads = jax.value_and_grad(loss)(params)
    return model, tokens, targets, float(value), grads


@pytest.fixture(scope="module")
def reference():
    return _reference(2, 0)


@pytest.mark.parametrize(
    "stages, slices",
    [
        (2, (8, 8, 8, 8)),  # 4 uniform slices
        (4, (4,) * 8),  # 8 uniform slices
        (2, (12, 9, 6, 5)),  # non-uniform, shrinking like a plan's
        (4, (3, 9, 4, 16)),  # non-uniform, any order
    ],
)
def test_pipelined_loss_and_gradients_equal_the_model(reference, stages, slices):
    model, tokens, targets, ref_loss, ref_grads = reference
    pipe = TokenPipeline(model, _stage_mesh(stages), slices)
    loss, grads = pipe.value_and_grad(pipe.params(), tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    grads = pipe.unstack(grads)
    for name in ("embed", "blocks", "head"):
        got, want = jax.tree.leaves(grads[name]), jax.tree.leaves(ref_grads[name])
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            scale = float(jnp.max(jnp.abs(w)))
            assert scale > 0
            assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * scale


def test_runs_a_planner_slicing(reference):
    model, tokens, targets, ref_loss, _ = reference
    cost = AnalyticCost(hidden=32, layers=2, flops=1e9, overhead_s=1e-4, saturation_tokens=1)
    plan = plan_tokens(CFG.seq_len, 2, cost, granularity=4, objective="lockstep")
    pipe = TokenPipeline(model, _stage_mesh(2), plan.slices)
    loss, _ = pipe.value_and_grad(pipe.params(), tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)


def test_bad_input(reference):
    model = reference[0]
    with pytest.raises(ValueError, match="add up to 30 tokens"):
        TokenPipeline(model, _stage_mesh(2), (10, 20))
    with pytest.raises(ValueError, match="do not split evenly over 3 stages"):
        TokenPipeline(model, _stage_mesh(3), (16, 16))
    with pytest.raises(ValueError, match="'stage' axis"):
        TokenPipeline(model, jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]), (16, 16))


@pytest.fixture(scope="module")
def reference4():  # 4 sequences: one per data-parallel device of a stage
    return _reference(4, 1)


def _zero_mesh(shape):
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, ("stage", "node", "local"), axis_types=(auto,) * 3)


@pytest.mark.parametrize("shape, slices", [((2, 2, 2), (12, 9, 6, 5)), ((4, 1, 2), (4,) * 8)])
def test_zero3_inside_the_stages_equals_the_model(reference4, shape, slices):
    from zpp_jax import ZeroPPConfig

    model, tokens, targets, ref_loss, ref_grads = reference4
    pipe = TokenPipeline(model, _zero_mesh(shape), slices, zero=ZeroPPConfig.zero3())
    params = pipe.params()
    assert params["blocks"].ndim == 3  # (stages, layers per stage, flat shards)
    loss, grads = pipe.value_and_grad(params, tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    grads = pipe.unstack(grads)
    for name in ("embed", "blocks", "head"):
        for g, w in zip(
            jax.tree.leaves(grads[name]), jax.tree.leaves(ref_grads[name]), strict=True
        ):
            assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * float(jnp.max(jnp.abs(w)))


def test_zeropp_inside_the_stages_runs(reference4):
    from zpp_jax import ZeroPPConfig

    model, tokens, targets, ref_loss, _ = reference4
    pipe = TokenPipeline(model, _zero_mesh((2, 2, 2)), (16, 16), zero=ZeroPPConfig())
    loss, grads = pipe.value_and_grad(pipe.params(), tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-3)  # int8 weights
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
