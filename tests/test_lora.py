"""LoRA over frozen weights stored as codes (`zpp.shard(freeze=)`,
`zpp_jax.lora`): the sharded model computes what the plain one does with
the same base, only the adapters train, and the base stays bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zpp_jax as zpp
from zpp_jax.analysis.report import state_bytes_per_device
from zpp_jax.errors import UsageError
from zpp_jax.frozen import FrozenParam, FrozenWeights
from zpp_jax.lora import FROZEN, add_lora, merge_lora
from zpp_jax.models import Llama, LlamaConfig
from zpp_jax.sharded import frozen_values, unshard
from zpp_jax.train import Trainer

CFG = LlamaConfig(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=16)
EXACT = zpp.ZeroPPConfig.zero3(comm_dtype=None)


def _lora_llama(rank=8, cfg=CFG):
    model = add_lora(Llama(cfg, nnx.Rngs(0)), rank)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(var.get_value() + 0.01)  # b is zero at first: make the adapters count
    return model


def _loss(model, tokens):
    return jnp.mean(model(tokens) ** 2)


@nnx.jit
def _grads(model, tokens):
    return nnx.grad(_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, tokens)


def _lora_grads(model, tokens):
    return dict(nnx.to_flat_state(_grads(model, tokens)))


@pytest.mark.slow  # the adapters' training and their bytes stay in the loop
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_a_sharded_lora_computes_what_the_plain_model_does(bits):
    """Logits and the adapters' gradients of the sharded model (ZeRO-3's
    exact wire) equal those of the plain model with the same base: the
    original weights when the base keeps its dtype, else the weights its
    codes decode to (`unshard`), to fp32 rounding."""
    mesh = zpp.make_mesh(2, 4)
    sharded = zpp.shard(_lora_llama(), mesh, EXACT.replace(frozen_bits=bits), freeze=FROZEN)
    plain = unshard(sharded)
    tokens = jnp.arange(8 * 16, dtype=jnp.int32).reshape(8, 16) % 64
    x = jax.device_put(tokens, zpp.batch_sharding(mesh))
    forward = nnx.jit(lambda m, x: m(x))
    logits = forward(sharded, x)
    np.testing.assert_allclose(logits, forward(plain, tokens), rtol=0, atol=2e-6)
    if bits is None:
        np.testing.assert_allclose(logits, forward(_lora_llama(), tokens), rtol=0, atol=2e-6)
    else:  # the codes are the base's, to the rounding of `bits` bits
        original = dict(nnx.to_flat_state(nnx.state(_lora_llama(), nnx.Param)))
        decoded = frozen_values(sharded)
        kernel = ("layers", 0, "mlp", "up", "base_module", "kernel")
        error = np.abs(np.asarray(decoded[kernel]) - original[kernel].get_value()).max()
        scale = np.abs(original[kernel].get_value()).max()
        assert 0 < error <= scale / (2 ** (bits - 1) - 1)
    got, want = _lora_grads(sharded, x), _lora_grads(plain, tokens)
    assert len(got) == 2 * 7 * 2  # two layers, seven adapted layers, a and b
    for key, value in want.items():
        np.testing.assert_allclose(got[key].get_value(), value.get_value(), rtol=0, atol=1e-8)


@pytest.mark.slow  # a training run
@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_training_moves_the_adapters_alone_and_keeps_the_base_bits(tied):
    """Five steps of the Trainer with every technique on (qwZ, hpZ, qgZ
    with error feedback) and a 4-bit base, with an LM head or with the
    embedding tied to it (`nnx.Embed.attend`, outside the unit's call):
    the adapted kernels are stored as codes, and every other frozen
    parameter (embedding, norms, head) is the model's own, bit for bit;
    neither changes; the adapters have moved, and the optimizer holds state
    for the adapters alone."""
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig(error_feedback=True, frozen_bits=4)
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    trainer = Trainer(_lora_llama(cfg=cfg), optax.adam(1e-2), mesh, config, freeze=FROZEN)
    state = trainer.init()
    codes = nnx.state(trainer.model(state), FrozenWeights)
    assert len(jax.tree.leaves(codes)) == 2  # the two layers' adapted kernels
    own = dict(nnx.to_flat_state(nnx.state(_lora_llama(cfg=cfg), nnx.Not(nnx.LoRAParam))))
    kept = {p: v for p, v in frozen_values(trainer.model(state)).items() if "base_module" not in p}
    norms = 2 * 2 + 1
    assert len(kept) == norms + (1 if tied else 2)  # the embedding, and the head if untied
    for path, value in kept.items():
        np.testing.assert_array_equal(np.asarray(value), own[path].get_value())

    def frozen(state):
        held = nnx.state(trainer.model(state), nnx.Any(FrozenParam, FrozenWeights))
        return [np.asarray(x) for x in jax.tree.leaves(held)]

    def adapters(state):
        return [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model(state), nnx.Param))]

    before, lora_before = frozen(state), adapters(state)
    rng = np.random.default_rng(0)
    for _ in range(5):
        tokens = rng.integers(0, 64, (8, 17)).astype(np.int32)
        batch = jax.device_put(
            {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, trainer.batch_sharding()
        )
        state, metrics = trainer.train_step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    assert len(before) == 2 + len(kept)
    for a, b in zip(before, frozen(state), strict=True):
        np.testing.assert_array_equal(a, b)
    moved = zip(lora_before, adapters(state), strict=True)
    assert all(not np.array_equal(a, b) for a, b in moved)
    adapter_elements = sum(a.size for a in lora_before)
    moments = [x for x in jax.tree.leaves(state[1]) if x.size > 1]
    assert sum(x.size for x in moments) == 2 * adapter_elements  # Adam's mu and nu


def test_codes_take_a_quarter_or_an_eighth_of_the_fp32_base():
    """Per device, a unit's stored int8 codes (with their scales) take at
    most 0.26x the bytes of the same weights kept in fp32, and int4 codes
    at most 0.14x; the units' codes are all of the layers' base."""

    def unit_bytes(bits):
        sharded = zpp.shard(
            _lora_llama(), zpp.make_mesh(2, 4), EXACT.replace(frozen_bits=bits), freeze=FROZEN
        )
        return state_bytes_per_device(nnx.state(sharded, FrozenWeights))

    fp32, int8, int4 = unit_bytes(None), unit_bytes(8), unit_bytes(4)
    assert int8 <= 0.26 * fp32 and int4 <= 0.14 * fp32, (fp32, int8, int4)


@pytest.mark.parametrize("alpha", [None, 32.0])
def test_merge_lora_folds_the_adapters_into_the_kernels(alpha):
    """The merged model computes what the adapted one does, with the
    update scaled by alpha / rank (4x here) or unscaled (no alpha)."""
    model = add_lora(Llama(CFG, nnx.Rngs(0)), 8, alpha=alpha)
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % 64
    plain = model(tokens)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(var.get_value() + 0.01)
    want = model(tokens)
    layer = model.layers[0].mlp.up
    x = jnp.ones((1, layer.in_features))
    update = x @ layer.lora_a[...] @ layer.lora_b[...]
    scale = 1.0 if alpha is None else 4.0
    np.testing.assert_allclose(layer(x) - layer.base_module(x), scale * update, rtol=1e-5)
    merged = merge_lora(model)
    assert not nnx.state(merged, nnx.LoRAParam)
    np.testing.assert_allclose(merged(tokens), want, rtol=0, atol=2e-6)
    assert np.abs(np.asarray(want) - np.asarray(plain)).max() > 1e-3


class UserModel(nnx.Module):
    """A model with nnx.LoRALinear layers of its own, not the library's."""

    def __init__(self, rngs):
        self.up = nnx.LoRALinear(32, 64, lora_rank=4, rngs=rngs)
        self.down = nnx.LoRALinear(64, 32, lora_rank=4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def test_any_model_with_lora_layers_trains_its_adapters_alone():
    """A user's model with `nnx.LoRALinear` layers, sharded with
    freeze=FROZEN (the model is one unit): the adapters' gradients equal
    the plain model's, and its kernels are frozen parameters."""
    mesh = zpp.make_mesh(2, 4)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 32)), jnp.float32)

    def make():
        model = UserModel(nnx.Rngs(0))
        for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
            var.set_value(var.get_value() + 0.05)
        return model

    sharded = zpp.shard(make(), mesh, EXACT.replace(frozen_bits=None), freeze=FROZEN)
    assert {p[-1] for p, _ in nnx.to_flat_state(nnx.state(sharded, nnx.Param))} == {
        "lora_a",
        "lora_b",
    }
    got = _lora_grads(sharded, jax.device_put(x, zpp.batch_sharding(mesh)))
    want = _lora_grads(make(), x)
    for key, value in want.items():
        np.testing.assert_allclose(got[key].get_value(), value.get_value(), rtol=0, atol=1e-7)


def test_bad_lora_settings_are_refused():
    with pytest.raises(UsageError, match="LoRA rank 0: use a positive number"):
        add_lora(Llama(CFG, nnx.Rngs(0)), 0)
    with pytest.raises(UsageError, match="no linear layer named attn_out in Llama"):
        add_lora(Llama(CFG, nnx.Rngs(0)), 4, targets=("attn_out",))
    with pytest.raises(UsageError, match="frozen_bits=2 is not supported"):
        zpp.ZeroPPConfig(frozen_bits=2)


def test_frozen_codes_restore_on_a_mesh_of_their_shape(tmp_path):
    """A checkpoint of a LoRA trainer restores its codes bit for bit on a
    mesh of the same shape; on another one, whose blocks differ, it is
    refused in one line naming the saved mesh; `saved_mesh` reads the
    shape from the files alone."""
    from zpp_jax.checkpoint import Checkpointer

    def trainer(mesh):
        return Trainer(_lora_llama(), optax.adam(1e-2), mesh, zpp.ZeroPPConfig(), freeze=FROZEN)

    saved = trainer(zpp.make_mesh(2, 4))
    state = saved.init()
    Checkpointer(tmp_path).save(1, state, mesh={"node": 2, "local": 4})
    assert Checkpointer.saved_mesh(tmp_path) == {"node": 2, "local": 4}
    again = trainer(zpp.make_mesh(2, 4))
    restored, _ = Checkpointer(tmp_path).restore(again.abstract_state())
    codes = jax.tree.leaves(nnx.state(saved.model(state), FrozenWeights))
    back = jax.tree.leaves(nnx.state(again.model(restored), FrozenWeights))
    assert len(codes) == len(back) == 2  # the two layers' adapted kernels
    for a, b in zip(codes, back, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = trainer(zpp.make_mesh(1, 4, devices=jax.devices()[:4]))
    with pytest.raises(UsageError, match="codes for a mesh of 2 x 4, whose blocks differ"):
        Checkpointer(tmp_path).restore(other.abstract_state())


@pytest.mark.slow
def test_the_lora_step_gathers_codes_and_reduces_the_adapters_through_qgz():
    """The compiled LoRA step (every technique on, int8 base): every
    all-gather of a unit carries bytes (codes, both the adapted kernels'
    and the adapters'), over the nodes and inside them (hpZ); the gradient
    reduction is qgZ's all-to-all, once per unit with adapters (the two
    layers: the embedding, final norm and head train nothing)."""
    from zpp_jax.analysis import step_report

    mesh = zpp.make_mesh(2, 4)
    trainer = Trainer(_lora_llama(), optax.adam(1e-3), mesh, zpp.ZeroPPConfig(), freeze=FROZEN)
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    report = step_report(trainer, {"inputs": tokens, "targets": tokens})
    gathers = [c for c in report["collectives"] if c["kind"] == "all-gather"]
    codes = [c for c in gathers if c["unit"]]
    assert codes and all(c["dtypes"] == ["u8"] for c in codes)
    assert {c["spans_nodes"] for c in codes} == {True, False}
    # The frozen parameters no adapter wraps travel in their own dtype (XLA's
    # gathers), each once a step: five norms, the embedding and the head.
    own = [c for c in gathers if not c["unit"]]
    assert all(c["dtypes"] == ["f32"] for c in own)
    assert sorted(c["bytes"] for c in own) == [64 * 4] * 5 + [64 * 64 * 4] * 2
    all_to_all = [c for c in report["collectives"] if c["kind"] == "all-to-all"]
    assert len(all_to_all) == 2 and all(set(c["dtypes"]) == {"u8"} for c in all_to_all)
