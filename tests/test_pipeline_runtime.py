"""The token-sliced pipelined GPT and Llama against the unpipelined models."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import two_rounding_bound
from flax import nnx

from zpp_jax import ZeroPPConfig
from zpp_jax.models.gpt import GPT, GPTConfig
from zpp_jax.models.llama import Llama, LlamaConfig
from zpp_jax.pipeline.runtime import TokenPipeline
from zpp_jax.train import cross_entropy

CFG = GPTConfig(seq_len=32, d_model=32, n_layers=4, n_heads=4, d_ff=64, dtype="float32")


def _stage_mesh(k):
    return jax.make_mesh(
        (k,), ("stage",), devices=jax.devices()[:k], axis_types=(jax.sharding.AxisType.Auto,)
    )


def _zero_mesh(shape):
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, ("stage", "node", "local"), axis_types=(auto,) * 3)


@functools.cache
def _data(batch, seed):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 256, (batch, CFG.seq_len)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 256, (batch, CFG.seq_len)), jnp.int32)
    return tokens, targets


@jax.jit
def _loss_and_grads(graphdef, params, rest, tokens, targets):
    def loss(params):
        return cross_entropy(nnx.merge(graphdef, params, rest)(tokens), targets)

    return jax.value_and_grad(loss)(params)


def _reference(model, tokens, targets, blocks=None):
    """The unpipelined model's loss and gradients (with `blocks` as its block
    parameters if given)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if blocks is not None:
        params = nnx.State({**params, "blocks": blocks})
    value, grads = _loss_and_grads(graphdef, params, rest, tokens, targets)
    return float(value), grads


def _close(got, want, tol=1e-5):
    """Every leaf within `tol` of the largest magnitude of its reference."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 0
        assert float(jnp.max(jnp.abs(g - w))) <= tol * scale


@pytest.fixture(scope="module")
def reference():
    model = GPT(CFG, nnx.Rngs(0))
    tokens, targets = _data(2, 0)
    return model, tokens, targets, *_reference(model, tokens, targets)


@pytest.mark.slow  # the scanned Llama's case stays in the loop
def test_pipelined_loss_and_gradients_equal_the_model(reference):
    """4 stages, slices in any order and more of them than stages. (Two
    stages: the Llama's test below, and tests/test_pipeline_train.py.)"""
    model, tokens, targets, ref_loss, ref_grads = reference
    pipe = TokenPipeline(model, _stage_mesh(4), (3, 9, 4, 6, 10))
    loss, grads = pipe.value_and_grad(pipe.params(), tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    grads = pipe.unstack(grads)
    for name in ("embed", "blocks", "head"):
        _close(grads[name], ref_grads[name])


@pytest.mark.parametrize(
    "scan", [pytest.param(False, marks=pytest.mark.slow), True], ids=["layer_list", "scanned"]
)
def test_pipelined_llama_equals_the_model(scan):
    """The Llama-style model (rotary positions at each slice's offset,
    2 key/value heads for 4 query heads), its layers a Python list or an
    `nnx.vmap` stack: loss and gradients of 2 stages over non-uniform slices
    (shrinking, like a plan's) equal the unpipelined model's."""
    cfg = LlamaConfig(
        seq_len=32, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, scan=scan
    )
    model = Llama(cfg, nnx.Rngs(0))
    tokens, targets = _data(2, 0)
    ref_loss, ref = _reference(model, tokens, targets)
    pipe = TokenPipeline(model, _stage_mesh(2), (12, 9, 6, 5))
    assert pipe.decoder.kv_width == 16  # the cache holds the 2 key/value heads only
    loss, grads = pipe.value_and_grad(pipe.params(), tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    grads = pipe.unstack(grads)
    layers = ref["layers"]
    if not scan:  # a list: stack its layers' gradients like the pipeline's
        layers = jax.tree.map(lambda *a: jnp.stack(a), *(layers[i] for i in range(cfg.n_layers)))
    _close(grads["blocks"], layers)
    for name in ("embed", "norm", "lm_head"):
        _close(grads[name], ref[name])


def test_bad_input(reference):
    model = reference[0]
    with pytest.raises(ValueError, match="add up to 30 tokens"):
        TokenPipeline(model, _stage_mesh(2), (10, 20))
    with pytest.raises(ValueError, match="do not split evenly over 3 stages"):
        TokenPipeline(model, _stage_mesh(3), (16, 16))
    with pytest.raises(ValueError, match="'stage' axis"):
        TokenPipeline(model, jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]), (16, 16))
    long = GPT(dataclasses.replace(CFG, seq_len=600), nnx.Rngs(0))
    with pytest.raises(ValueError, match="600 slices: .* at most 512 slices"):
        TokenPipeline(long, _stage_mesh(2), (1,) * 600)
    with pytest.raises(
        ValueError,
        match=r"Linear does not say how it runs as a token pipeline: .* pipeline_decoder\(\)",
    ):
        TokenPipeline(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), _stage_mesh(2), (16, 16))


@pytest.fixture(scope="module")
def reference4():  # 4 sequences: one per data-parallel device of a stage
    model = GPT(CFG, nnx.Rngs(0))
    tokens, targets = _data(4, 1)
    return model, tokens, targets


def _used_blocks(pipe, config):
    """The block parameters (L, ...) as the stages compute with them: the
    flat shards as they arrive (qwZ: dequantized codes), and the flat ones."""
    from blocks import used_weights

    flat = pipe.params()["blocks"]
    flat = jnp.asarray(flat).reshape(-1, flat.shape[-1])
    used = used_weights(flat, pipe.layout, config)
    return jax.vmap(pipe.layout.unflatten)(used), used


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, slices, config",
    [
        ((4, 1, 2), (8, 8, 8, 8), ZeroPPConfig(quantize_gradients=False)),
    ],
    ids=["qwz+hpz"],
)
def test_zero_inside_the_stages_equals_the_model(reference4, shape, slices, config):
    """int8 weights with hpZ (the weights gathered once, the stages computing
    with the dequantized weights, forward and backward): loss and gradients
    equal the unpipelined model's at those weights. (Exact ZeRO-3 inside the
    stages is tests/test_pipeline_train.py's.)"""
    model, tokens, targets = reference4
    pipe = TokenPipeline(model, _zero_mesh(shape), slices, zero=config)
    params = pipe.params()
    assert params["blocks"].ndim == 3  # (stages, layers per stage, flat shards)
    used, _ = _used_blocks(pipe, config)
    ref_loss, ref_grads = _reference(model, tokens, targets, used)
    loss, grads = pipe.value_and_grad(params, tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    grads = pipe.unstack(grads)
    for name in ("embed", "blocks", "head"):
        _close(grads[name], ref_grads[name])


@pytest.mark.slow
def test_zeropp_inside_the_stages_within_the_reduction_bound(reference4):
    """Full ZeRO++ (int8 weights, hpZ, int4 gradients) inside 2 stages of
    2 x 2 devices. With one slice each layer's gradient is reduced once (an
    idle step contributes exact zeros), so it is the unpipelined model's
    (at the dequantized weights) within the two roundings of the quantized
    reduction, computed from each data-parallel device's own gradient."""
    model, tokens, targets = reference4
    config = ZeroPPConfig()
    pipe = TokenPipeline(model, _zero_mesh((2, 2, 2)), (CFG.seq_len,), zero=config)
    used, used_flat = _used_blocks(pipe, config)
    ref_loss, ref_grads = _reference(model, tokens, targets, used)
    loss, grads = pipe.value_and_grad(pipe.params(), tokens, targets)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    flat = np.asarray(grads["blocks"]).reshape(CFG.n_layers, -1)
    unstacked = pipe.unstack(grads)
    for name in ("embed", "head"):  # replicated, not quantized
        _close(unstacked[name], ref_grads[name])
    # per data-parallel device (one sequence each): its own gradient, flat
    per_device = np.stack(
        [
            np.asarray(
                jax.vmap(pipe.layout.flatten)(
                    _reference(model, tokens[d : d + 1], targets[d : d + 1], used)[1]["blocks"]
                )
            )
            for d in range(4)
        ]
    )  # (devices, layers, N*s)
    mean = per_device.astype(np.float64).mean(0)
    scale = np.max(np.abs(mean))
    for layer in range(CFG.n_layers):
        bound = two_rounding_bound(
            per_device[:, layer],
            2,
            2,
            4,
            config.grad_block,
            config.gradient_rounding,
            config.gradient_scale_dtype,
        )
        err = np.abs(flat[layer] - mean[layer])
        assert np.all(err <= bound * (1 + 1e-4) + 1e-5 * scale)
        assert np.max(err) > 0  # the gradients were quantized
