import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from stopped_run import copy_stopped_after

from zpp_jax import Trainer, UsageError, ZeroPPConfig, make_mesh, unshard
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.recipes import RunConfig, run
from zpp_jax.train import cross_entropy

CFG = GPTConfig.preset("tiny", dtype="float32", seq_len=16, n_layers=2)
EXACT = ZeroPPConfig.zero3(comm_dtype=None)  # fp32 wire: an unsharded model's numbers


def _batch(seed=1, b=16):
    tok = np.random.default_rng(seed).integers(0, 256, (b, CFG.seq_len + 1), dtype=np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


@functools.cache
def _reference(b):
    """The unsharded model's loss, gradients and parameters on `_batch(b=b)`."""
    model = GPT(CFG, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = _batch(b=b)

    @jax.jit
    def value_and_grad(params):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(batch["inputs"])
            return cross_entropy(logits, batch["targets"])

        return jax.value_and_grad(loss)(params)

    loss, grads = value_and_grad(params)
    return float(loss), grads, params


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)


def _params(trainer, state):
    return nnx.state(unshard(trainer.model(state)), nnx.Param)


# A fixed clip below the gradient norm of _batch(b=32), so clipping is active.
CLIP = 0.2


def _exact_step(mesh, grad_accum=1):
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(1.0))
    trainer = Trainer(GPT(CFG, nnx.Rngs(0)), tx, mesh, EXACT, grad_accum=grad_accum)
    state, metrics = trainer.train_step(
        trainer.init(), jax.device_put(_batch(b=32), trainer.batch_sharding())
    )
    return trainer, state, metrics


@functools.cache
def _exact_step_cached(mesh):
    return _exact_step(mesh)


def test_zero3_step_with_clipping_equals_unsharded(mesh):
    ref_loss, ref_grads, before = _reference(32)
    norm = float(optax.tree.norm(ref_grads))
    assert norm > 2 * CLIP  # clipping is active (by a margin)
    trainer, state, metrics = _exact_step_cached(mesh)
    assert abs(float(metrics["loss"]) - ref_loss) <= 1e-5 * ref_loss
    assert abs(float(metrics["grad_norm"]) - norm) <= 1e-5 * norm
    expect = jax.tree.map(lambda p, g: p - g * CLIP / norm, before, ref_grads)
    new = _params(trainer, state)
    assert len(jax.tree.leaves(new)) == len(jax.tree.leaves(expect))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expect), strict=True):
        assert a.shape == b.shape and _max_rel(a, b) <= 1e-5
    assert Trainer.steps_done(state) == 1


@pytest.mark.slow  # clipping stays in the loop: test_zero3_step_with_clipping_equals_unsharded
def test_max_grad_norm_clips_as_optax_does(mesh24):
    """`max_grad_norm` (the norm from one all-reduce) gives the step of
    ``optax.clip_by_global_norm`` first in the chain; a norm below it
    leaves the gradients as they are."""
    t1, s1, m1 = _exact_step_cached(mesh24)
    batch = jax.device_put(_batch(b=32), t1.batch_sharding())
    for bound, clips in ((CLIP, True), (1e9, False)):
        trainer = Trainer(GPT(CFG, nnx.Rngs(0)), optax.sgd(1.0), mesh24, EXACT, max_grad_norm=bound)
        state, m = trainer.train_step(trainer.init(), batch)
        assert abs(float(m["grad_norm"]) - float(m1["grad_norm"])) <= 1e-6 * float(m1["grad_norm"])
        ref_tx = optax.chain(optax.clip_by_global_norm(bound), optax.sgd(1.0))
        ref = Trainer(GPT(CFG, nnx.Rngs(0)), ref_tx, mesh24, EXACT)
        ref_state, _ = ref.train_step(ref.init(), batch)
        got, want = _params(trainer, state), _params(ref, ref_state)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert _max_rel(a, b) <= 1e-6
        assert clips == (float(m["grad_norm"]) > bound)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_max_grad_norm_must_be_positive_and_finite(mesh24, bad):
    with pytest.raises(ValueError, match="max_grad_norm must be a positive finite number"):
        Trainer(GPT(CFG, nnx.Rngs(0)), optax.sgd(0.1), mesh24, max_grad_norm=bad)


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_grad_accumulation_matches_one_big_batch(mesh24, k):
    t1, s1, m1 = _exact_step_cached(mesh24)
    trainer, state, m = _exact_step(mesh24, grad_accum=k)
    assert abs(float(m["loss"]) - float(m1["loss"])) <= 1e-6 * float(m1["loss"])
    assert abs(float(m["grad_norm"]) - float(m1["grad_norm"])) <= 1e-5 * float(m1["grad_norm"])
    one = _params(t1, s1)
    for a, b in zip(jax.tree.leaves(_params(trainer, state)), jax.tree.leaves(one), strict=True):
        assert _max_rel(a, b) <= 1e-5


def test_batch_must_split_evenly(mesh24):
    tr = Trainer(GPT(CFG, nnx.Rngs(0)), optax.sgd(0.1), mesh24, ZeroPPConfig(), grad_accum=2)
    batch = jax.tree.map(jnp.asarray, _batch(b=8))
    with pytest.raises(ValueError, match="multiple of devices x grad_accum = 8 x 2"):
        tr.train_step.trace(tr.abstract_state(), batch)


def test_a_batch_the_default_loss_cannot_read_is_named(mesh24):
    """While the step is traced, before any compile: a batch of other keys
    (Hugging Face's), of floats, of one dimension, of unlike shapes, or
    whose arrays have unlike row counts."""
    tr = Trainer(GPT(CFG, nnx.Rngs(0)), optax.sgd(0.1), mesh24, ZeroPPConfig())
    good = jax.tree.map(jnp.asarray, _batch(b=8))
    tokens, targets = good["inputs"], good["targets"]
    cases = [
        ({"input_ids": tokens, "labels": targets}, r"got \['input_ids', 'labels'\]: rename"),
        ((tokens, targets), "reads a dict of 'inputs' and 'targets' .* got tuple"),
        ({"inputs": tokens * 1.0, "targets": targets}, "holds token ids, integers: got float32"),
        ({"inputs": tokens[:, :8], "targets": targets}, r"alike: got \{'inputs': \(8, 8\)"),
        ({"inputs": tokens.reshape(-1)[:64], "targets": targets.reshape(-1)[:64]}, r"\(64,\)"),
        ({**good, "weights": jnp.ones(16)}, r"rows first, as many in each: got \['inputs'\]"),
        ({}, "the batch holds no array"),
    ]
    for batch, message in cases:
        with pytest.raises(UsageError, match=message):
            tr.train_step.trace(tr.abstract_state(), batch)


# A non-finite update's skip stays in the loop (test_a_step_whose_update_is_not_finite_is_skipped).
@pytest.mark.slow
@pytest.mark.parametrize("error_feedback", [False, True])
def test_nan_gradient_skips_the_step(mesh24, error_feedback):
    def poisoned_loss(model, batch):
        ce = cross_entropy(model(batch["inputs"]), batch["targets"])
        return ce * jnp.mean(batch["poison"])  # NaN from one device's rows only

    cfg = ZeroPPConfig(error_feedback=error_feedback)
    tr = Trainer(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-2), mesh24, cfg, loss_fn=poisoned_loss)
    clean = {**_batch(), "poison": jnp.ones((16,))}
    poisoned = {**clean, "poison": clean["poison"].at[5].set(jnp.nan)}
    state, m = tr.train_step(tr.init(), jax.device_put(clean, tr.batch_sharding()))
    assert int(m["skipped"]) == 0
    before = jax.tree.map(np.asarray, state)  # the step donates its input
    state, m = tr.train_step(state, jax.device_put(poisoned, tr.batch_sharding()))
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["grad_norm"]))
    after = jax.tree.map(np.asarray, state)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    assert Trainer.steps_done(state) == 1
    state, m = tr.train_step(state, jax.device_put(clean, tr.batch_sharding()))
    assert int(m["skipped"]) == 0 and Trainer.steps_done(state) == 2
    assert np.isfinite(float(m["loss"]))


# One run configuration for the tests of `run`: with fewer steps than the
# warmup, the learning-rate schedule, and so the compiled step, is the same
# for every length, and later runs load it from the compilation cache.
RUN = dict(
    zero=ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True),
    batch=8,
    eval_every=2,
    eval_batches=1,
    progress=False,
)


@pytest.mark.slow
def test_zeropp_learns_context():
    """40 steps of ZeRO++ on the default corpus: the validation loss falls
    below the byte-unigram entropy of the validation text, which no model
    that ignores the preceding bytes can reach (cross-entropy >= entropy).
    (ZeRO-3 learning, and ZeRO++'s gap to it, are tests/test_shard_convergence.py's.)"""
    from zpp_jax.data import TokenDataset, stdlib_corpus

    val = TokenDataset(stdlib_corpus(), CFG.seq_len).splits["val"]
    p = np.bincount(val, minlength=256) / len(val)
    unigram_entropy = -np.sum(p[p > 0] * np.log(p[p > 0]))
    base = dict(steps=40, eval_every=40, eval_batches=8, progress=False)
    for zero in (ZeroPPConfig(comm_dtype="bfloat16"),):
        records = run(RunConfig(zero=zero, **base))
        assert records[-1]["val_loss"] < unigram_entropy, (zero, records[-1])


@pytest.mark.slow  # a step compiled for a mesh of its own
def test_single_node_mesh(mesh24):
    # 1 x 8: hierarchical steps over the node axis are skipped.
    tr = Trainer(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-2), make_mesh(1, 8), ZeroPPConfig())
    state, m = tr.train_step(tr.init(), jax.device_put(_batch(), tr.batch_sharding()))
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0


@pytest.mark.slow  # training runs
def test_resume_is_bitwise(tmp_path):
    """A run stopped after its checkpoint and resumed by a new run (a new
    trainer and checkpointer reading the directory) writes the same metrics
    and reaches the same state, bit for bit, as one never stopped. (Its
    first two steps are two runs of the same seed, bit for bit; another
    seed draws other parameters.)"""
    import json

    from zpp_jax import Checkpointer
    from zpp_jax.recipes.train import make_model, make_trainer

    def train(name, steps, resume=False):
        ckpt, metrics = str(tmp_path / name), str(tmp_path / f"{name}.jsonl")
        cfg = RunConfig(steps=steps, ckpt_dir=ckpt, metrics=metrics, resume=resume, **RUN)
        return run(dataclasses.replace(cfg, ckpt_every=2))

    train("a", 4)
    # b: run a as it was when stopped after checkpoint 2 (its directory and
    # its metrics then), resumed by a new run
    copy_stopped_after(
        2, tmp_path / "a", tmp_path / "a.jsonl", tmp_path / "b", tmp_path / "b.jsonl"
    )
    assert [r["step"] for r in train("b", 4, resume=True)] == [3, 4]  # the steps it had left
    records = {
        k: [json.loads(x) for x in (tmp_path / f"{k}.jsonl").read_text().splitlines()] for k in "ab"
    }
    assert len(records["a"]) == 4
    for key in ("step", "loss", "grad_norm", "val_loss"):
        assert [r.get(key) for r in records["a"]] == [r.get(key) for r in records["b"]], key
    # Another seed draws other parameters (and other batches: test_data.py).
    params = [
        jax.tree.leaves(nnx.state(make_model(RunConfig(seed=seed, **RUN)), nnx.Param))
        for seed in (0, 1)
    ]
    assert not all(np.array_equal(a, b) for a, b in zip(*params, strict=True))
    target = make_trainer(RunConfig(**RUN)).abstract_state()
    (sa, ma), (sb, mb) = (Checkpointer(tmp_path / k).restore(target) for k in "ab")
    assert ma["data_position"] == mb["data_position"] == 4 and Trainer.steps_done(sa) == 4
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_step_whose_update_is_not_finite_is_skipped(mesh24):
    """Finite loss and gradients but a NaN learning rate: the update would
    make every parameter NaN, so the step is skipped and the state kept."""
    trainer = Trainer(GPT(CFG, nnx.Rngs(0)), optax.sgd(float("nan")), mesh24, EXACT)
    before = jax.tree.map(np.asarray, trainer.init())
    state, metrics = trainer.train_step(
        trainer.init(), jax.device_put(_batch(b=32), trainer.batch_sharding())
    )
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["skipped"]) == 1
    after = jax.tree.map(np.asarray, state)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_metrics_lines_are_strict_json():
    import json

    from zpp_jax.recipes.train import json_record

    line = json_record({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "skipped": 1})
    assert json.loads(line) == {
        "step": 3,
        "loss": None,
        "grad_norm": None,
        "skipped": 1,
        "nonfinite": ["loss", "grad_norm"],
    }
    assert json.loads(json_record({"step": 1, "loss": 2.5})) == {"step": 1, "loss": 2.5}


def test_abstract_model_compiles_the_same_step(mesh24):
    """A Trainer on an nnx.eval_shape model allocates nothing, has the
    concrete Trainer's state layout (optimizer moments and error-feedback
    residuals sharded like the parameters) and lowers to the same step."""
    from zpp_jax.analysis import state_bytes_per_device

    cfg = ZeroPPConfig(error_feedback=True)
    concrete = Trainer(GPT(CFG, nnx.Rngs(0)), optax.adamw(1e-3), mesh24, cfg)
    abstract = Trainer(
        nnx.eval_shape(lambda: GPT(CFG, nnx.Rngs(0))), optax.adamw(1e-3), mesh24, cfg
    )
    want, got = concrete.abstract_state(), abstract.abstract_state()
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert (w.shape, w.dtype) == (g.shape, g.dtype)
        assert w.sharding.is_equivalent_to(g.sharding, w.ndim), (w, g)
    assert state_bytes_per_device(got) == state_bytes_per_device(concrete.init()) > 0
    tokens = jax.ShapeDtypeStruct((16, CFG.seq_len), jnp.int32, sharding=concrete.batch_sharding())
    batch = {"inputs": tokens, "targets": tokens}
    lowered = [
        t.train_step.lower(t.abstract_state(), batch).as_text() for t in (concrete, abstract)
    ]
    assert lowered[0] == lowered[1]
    with pytest.raises(UsageError, match="abstract model"):
        abstract.init()


def test_a_step_that_calls_no_unit_is_refused(mesh24):
    """A loss that never calls the model's units (here a penalty on one
    weight) would train with none of the engine: the step refuses it."""
    trainer = Trainer(
        GPT(CFG, nnx.Rngs(0)),
        optax.sgd(0.1),
        mesh24,
        EXACT,
        loss_fn=lambda model, batch: jnp.sum(jnp.square(model.embed.positions[...])),
    )
    with pytest.raises(UsageError, match="the Trainer's loss_fn called none of the model's units"):
        trainer.train_step(trainer.init(), jax.device_put(_batch(), trainer.batch_sharding()))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_runs_parameters_are_drawn_as_eager_construction_draws_them(arch):
    """`make_model` draws the parameters in one compiled program: the same
    every time, and the values of constructing the model eagerly with the
    run's seed, to the last bit of the float32 arithmetic (XLA may fuse
    the initializers' arithmetic differently)."""
    from zpp_jax.recipes.train import make_model, model_class, model_config

    cfg = RunConfig(arch=arch, seed=3, vocab_size=256)
    eager = model_class(cfg)(model_config(cfg), nnx.Rngs(3))
    first, again, want = (
        jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (make_model(cfg), make_model(cfg), eager)
    )
    assert len(first) == len(want) > 0
    for a, b, c in zip(first, again, want, strict=True):
        assert a.dtype == c.dtype and a.shape == c.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2**-22, atol=2**-30)
