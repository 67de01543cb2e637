"""The recipe's optimizer: optax's warmup-cosine AdamW with the schedule's
numbers as data, so that one compiled step serves every learning rate,
warmup, weight decay and step count, and one initializer every seed."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zpp_jax.recipes import RunConfig, build, run
from zpp_jax.recipes.optimizer import schedule_hyperparams, warmup_cosine, with_schedule_of
from zpp_jax.recipes.train import make_model, make_trainer

BASE = RunConfig(seq_len=16, batch=8, vocab_size=256, warmup=1, eval_every=0, progress=False)


@pytest.mark.parametrize(
    ("lr", "warmup", "steps"), [(3e-3, 1, 2), (3e-3, 10, 100), (1e-4, 7, 1000), (0.5, 100, 101)]
)
def test_the_schedule_is_optaxs(lr, warmup, steps):
    """At every step and past the end, to float32 round-off of the peak
    (the same formulas; XLA may fuse them differently, and where the cosine
    is near its end the few ulp of a cosine are a larger share)."""
    counts = jnp.arange(steps + 5)
    ours = jax.jit(jax.vmap(warmup_cosine, (0, None, None, None)))(counts, lr, warmup, steps)
    optaxs = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * 0.1)
    expected = jax.vmap(optaxs)(counts)
    assert float(ours[0]) == 0.0 and float(ours[warmup]) == np.float32(lr)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=4 * 2.0**-24 * lr)
    np.testing.assert_allclose(ours[steps:], np.float32(lr * 0.1), rtol=0, atol=4 * 2.0**-24 * lr)


def _step_program(cfg):
    trainer = make_trainer(cfg)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len), jnp.int32)
    tokens = tokens.update(sharding=trainer.batch_sharding())
    batch = {"inputs": tokens, "targets": tokens}
    return trainer.train_step.lower(trainer.abstract_state(), batch).as_text()


def test_one_step_program_serves_every_schedule():
    other = dataclasses.replace(BASE, lr=1e-4, warmup=7, steps=123, weight_decay=0.0)
    assert _step_program(BASE) == _step_program(other)


def test_one_initializer_serves_every_seed():
    """The second seed's parameters come from the program the first one
    compiled: no compilation cache miss."""
    misses = collections.Counter()

    def count(event, **kwargs):
        misses[event] += 1

    jax.monitoring.register_event_listener(count)
    try:
        first = make_model(dataclasses.replace(BASE, seed=0))
        misses.clear()
        second = make_model(dataclasses.replace(BASE, seed=1))
        assert misses["/jax/compilation_cache/cache_misses"] == 0, misses
    finally:
        jax.monitoring.unregister_event_listener(count)
    params = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (first, second)]
    drawn = [(a, b) for a, b in zip(*params, strict=True) if np.std(a) > 0]  # not ones, zeros
    assert drawn and not any(np.array_equal(a, b) for a, b in drawn)


def _hyperparams(state):
    found = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = [getattr(k, "key", None) for k in path]
        if "hyperparams" in names:
            found[names[names.index("hyperparams") + 1]] = leaf
    return found


def test_a_restored_state_takes_this_runs_schedule():
    state = make_trainer(dataclasses.replace(BASE, steps=3)).init()
    longer = dataclasses.replace(BASE, steps=50)
    before, after = _hyperparams(state), _hyperparams(with_schedule_of(state, longer))
    assert {k: v.item() for k, v in after.items()} == pytest.approx(schedule_hyperparams(longer))
    assert after["decay_steps"].item() == 50 and before["decay_steps"].item() == 3
    for name, leaf in after.items():
        assert leaf.dtype == before[name].dtype and leaf.sharding == before[name].sharding
    others = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)]
    replaced = jax.tree.leaves(with_schedule_of(state, longer))
    unchanged = sum(a is b for a, b in zip(others, replaced, strict=True))
    assert unchanged == len(others) - 4


@pytest.mark.slow  # a training run
def test_a_resumed_run_decays_over_its_new_step_count(tmp_path):
    """`--resume` with more `--steps` than the run was started with: the
    cosine now ends at the new count (the schedule is not part of the
    run's identity; the learning rate and warmup are)."""
    cfg = dataclasses.replace(BASE, steps=2, ckpt_every=2, ckpt_dir=str(tmp_path / "c"), plot=None)
    run(cfg)
    job = build(dataclasses.replace(cfg, steps=6, resume=True))
    assert job.position == 2
    assert _hyperparams(job.state)["decay_steps"].item() == 6
