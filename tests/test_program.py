"""zpp_jax.program: one contract for every trainer, one step finish."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zpp_jax import Trainer, UsageError, ZeroPPConfig
from zpp_jax.analysis import collectives_in_hlo
from zpp_jax.baseline import JitFSDP
from zpp_jax.lowlevel import make_pipeline_mesh
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.pipeline import PipelineTrainer
from zpp_jax.program import TrainingProgram, clip_to_norm, finish_step

CFG = GPTConfig(seq_len=32, d_model=32, n_layers=4, n_heads=4, d_ff=64, dtype="float32")


def _pipeline(**kwargs):
    return PipelineTrainer(
        GPT(CFG, nnx.Rngs(0)),
        optax.adamw(1e-3),
        make_pipeline_mesh(2, 2, 2),
        (16, 16),
        ZeroPPConfig(),
        **kwargs,
    )


def test_every_trainer_is_a_training_program(mesh24):
    programs = [
        Trainer(GPT(CFG, nnx.Rngs(0)), optax.adamw(1e-3), mesh24),
        JitFSDP(GPT(CFG, nnx.Rngs(0)), optax.adamw(1e-3), mesh24),
        _pipeline(),
    ]
    for program in programs:
        assert isinstance(program, TrainingProgram), type(program).__name__
        assert program.steps_done(program.init()) == 0
    with pytest.raises(UsageError, match="must be a multiple of the 8 data devices"):
        programs[1].check_batch_size(12)


@pytest.mark.slow  # the pipeline's exactness stays in the loop
def test_the_pipeline_trainer_compiles_its_step_and_refuses_micro_batches():
    """`compile_step` compiles the whole training step without running it:
    each stage's layers are gathered once per step (ZeRO inside the
    stages), as in the pipeline's gradient step."""
    trainer = _pipeline()
    tokens = jax.ShapeDtypeStruct((4, CFG.seq_len), jnp.int32)
    compiled = trainer.compile_step({"inputs": tokens, "targets": tokens})
    gathers = [c for c in collectives_in_hlo(compiled.as_text()) if c.kind == "all-gather"]
    assert gathers and all(c.runs == CFG.n_layers // 2 for c in gathers)
    assert trainer.steps_done(trainer.init()) == 0  # nothing ran
    with pytest.raises(UsageError, match="grad_accum=2: the token pipeline splits each sequence"):
        _pipeline(grad_accum=2)


def _finish(state, loss, grads, max_norm=None, lr=1.0):
    norm = optax.tree.norm(grads)

    def update(g):
        return jax.tree.map(lambda p, d: p - lr * d, state, g)

    def all_finite(new):
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new)]))

    return finish_step(state, loss, grads, norm, max_norm, update, all_finite)


def test_finish_step_clips_updates_and_reports():
    state = {"w": jnp.array([1.0, 2.0])}
    grads = {"w": jnp.array([3.0, 4.0])}  # norm 5
    new, metrics = _finish(state, jnp.float32(0.5), grads, max_norm=1.0)
    np.testing.assert_allclose(new["w"], [1.0 - 0.6, 2.0 - 0.8], rtol=1e-6)
    assert float(metrics["grad_norm"]) == 5.0 and int(metrics["skipped"]) == 0
    assert float(metrics["loss"]) == 0.5
    new, _ = _finish(state, jnp.float32(0.5), grads)  # no clipping
    np.testing.assert_allclose(new["w"], [-2.0, -2.0])
    np.testing.assert_allclose(clip_to_norm(grads, jnp.float32(5.0), 10.0)["w"], [3.0, 4.0])


@pytest.mark.parametrize("what", ["loss", "gradient", "update"])
def test_a_step_that_is_not_finite_leaves_the_state_as_it_was(what):
    state = {"w": jnp.array([1.0, 2.0])}
    loss = jnp.float32(jnp.nan if what == "loss" else 0.5)
    grads = {"w": jnp.array([jnp.inf if what == "gradient" else 1.0, 1.0])}
    lr = jnp.nan if what == "update" else 1.0
    new, metrics = _finish(state, loss, grads, lr=lr)
    np.testing.assert_array_equal(new["w"], state["w"])
    assert int(metrics["skipped"]) == 1
