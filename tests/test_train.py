import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zpp_jax import (
    GPT,
    GPTConfig,
    Trainer,
    ZeroPPConfig,
    cross_entropy,
    make_mesh,
    nnx_parts,
)
from zpp_jax.train_gpt import RunConfig, run

CFG = GPTConfig.preset("tiny", dtype="float32", seq_len=16, n_layers=2)


def _batch(seed=1, b=16):
    tok = jax.random.randint(jax.random.key(seed), (b, CFG.seq_len + 1), 0, 256)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _reference_grads(model, batch):
    def loss(m):
        return cross_entropy(m(batch["inputs"]), batch["targets"])

    return nnx.value_and_grad(loss)(model)


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)


def test_zero3_step_with_clipping_equals_unsharded(mesh):
    model = GPT(CFG, nnx.Rngs(0))
    batch = _batch()
    ref_loss, ref_grads = _reference_grads(model, batch)
    ref_grads = nnx.state(ref_grads, nnx.Param)
    norm = float(optax.tree.norm(ref_grads))
    clip = norm / 4  # clipping is active
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0))
    trainer = Trainer(nnx_parts(model), tx, mesh, ZeroPPConfig.zero3(), jnp.float32)
    state, metrics = trainer.step(trainer.init(), jax.device_put(batch, trainer.batch_sharding()))
    assert abs(float(metrics["loss"]) - float(ref_loss)) <= 1e-5 * float(ref_loss)
    assert abs(float(metrics["grad_norm"]) - norm) <= 1e-5 * norm
    new = trainer.export(state)
    before = nnx.state(model, nnx.Param)
    for group in ("embed", "blocks", "head"):
        expect = jax.tree.map(lambda p, g: p - g * clip / norm, before[group], ref_grads[group])
        for a, b in zip(jax.tree.leaves(new[group]), jax.tree.leaves(expect), strict=True):
            assert _max_rel(a, b) <= 1e-5


def test_grad_accumulation_matches_one_big_batch(mesh24):
    model = GPT(CFG, nnx.Rngs(0))
    batch = _batch(b=32)
    out = {}
    for k in (1, 2, 4):
        tr = Trainer(
            nnx_parts(model),
            optax.sgd(0.5),
            mesh24,
            ZeroPPConfig.zero3(),
            jnp.float32,
            grad_accum=k,
        )
        state, m = tr.step(tr.init(), jax.device_put(batch, tr.batch_sharding()))
        out[k] = (float(m["loss"]), float(m["grad_norm"]), tr.export(state))
    for k in (2, 4):
        assert abs(out[k][0] - out[1][0]) <= 1e-6 * out[1][0]
        assert abs(out[k][1] - out[1][1]) <= 1e-5 * out[1][1]
        for a, b in zip(jax.tree.leaves(out[k][2]), jax.tree.leaves(out[1][2]), strict=True):
            assert _max_rel(a, b) <= 1e-5


def test_batch_must_split_evenly(mesh24):
    tr = Trainer(
        nnx_parts(GPT(CFG, nnx.Rngs(0))), optax.sgd(0.1), mesh24, ZeroPPConfig(), grad_accum=2
    )
    with pytest.raises(ValueError, match="multiple of devices x grad_accum = 8 x 2"):
        tr.step(tr.init(), _batch(b=8))


@pytest.mark.parametrize("error_feedback", [False, True])
def test_nan_gradient_skips_the_step(mesh24, error_feedback):
    def poisoned_loss(logits, batch):
        ce = cross_entropy(logits, batch["targets"])
        return ce * jnp.mean(batch["poison"])  # NaN on one device only

    cfg = ZeroPPConfig(error_feedback=error_feedback)
    tr = Trainer(
        nnx_parts(GPT(CFG, nnx.Rngs(0))), optax.adam(1e-2), mesh24, cfg, loss_fn=poisoned_loss
    )
    clean = {**_batch(), "poison": jnp.ones((16,))}
    poisoned = {**clean, "poison": clean["poison"].at[5].set(jnp.nan)}
    state, m = tr.step(tr.init(), jax.device_put(clean, tr.batch_sharding()))
    assert int(m["skipped"]) == 0
    before = jax.tree.map(np.asarray, state)  # the step donates its input
    state, m = tr.step(state, jax.device_put(poisoned, tr.batch_sharding()))
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["grad_norm"]))
    after = jax.tree.map(np.asarray, state)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(state.step) == 1
    state, m = tr.step(state, jax.device_put(clean, tr.batch_sharding()))
    assert int(m["skipped"]) == 0 and int(state.step) == 2 and np.isfinite(float(m["loss"]))


def test_same_seed_same_losses_bitwise():
    cfg = RunConfig(steps=6, eval_every=3, eval_batches=1, progress=False, batch=8)
    a, b = run(cfg), run(cfg)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    c = run(RunConfig(steps=6, eval_every=3, eval_batches=1, progress=False, batch=8, seed=1))
    assert [r["loss"] for r in a] != [r["loss"] for r in c]


def test_zeropp_trains_close_to_zero3():
    """Short version of the convergence check (benchmarks/convergence.py runs 300 steps)."""
    base = dict(steps=60, eval_every=60, eval_batches=8, progress=False)
    z3 = run(RunConfig(zero=ZeroPPConfig.zero3(comm_dtype="bfloat16"), **base))
    zpp = run(RunConfig(**base))
    assert z3[-1]["loss"] < z3[0]["loss"] - 1.0  # it learns
    assert abs(zpp[-1]["val_loss"] - z3[-1]["val_loss"]) <= 0.02 * z3[-1]["val_loss"]
    mean = lambda r: np.mean([x["loss"] for x in r[-10:]])  # noqa: E731
    assert abs(mean(zpp) - mean(z3)) <= 0.02 * mean(z3)


def test_single_node_mesh_and_pmap_style_axes(mesh24):
    # 1 x 8: hierarchical steps over the node axis are skipped.
    tr = Trainer(
        nnx_parts(GPT(CFG, nnx.Rngs(0))), optax.adam(1e-2), make_mesh(1, 8), ZeroPPConfig()
    )
    state, m = tr.step(tr.init(), jax.device_put(_batch(), tr.batch_sharding()))
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0


def test_resume_in_a_new_process_is_bitwise(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from zpp_jax import Checkpointer
    from zpp_jax.train_gpt import make_trainer

    common = [
        "--quiet",
        "--batch",
        "8",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--error-feedback",
    ]

    def train(*args):
        cmd = [sys.executable, "-m", "zpp_jax", "train", *common, *args]
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]

    a, b = tmp_path / "a", tmp_path / "b"
    train("--steps", "40", "--ckpt-dir", str(a), "--metrics", str(tmp_path / "a.jsonl"))
    train("--steps", "20", "--ckpt-dir", str(b), "--metrics", str(tmp_path / "b.jsonl"))
    train("--steps", "40", "--ckpt-dir", str(b), "--metrics", str(tmp_path / "b.jsonl"), "--resume")
    losses = {
        k: [json.loads(x)["loss"] for x in (tmp_path / f"{k}.jsonl").read_text().splitlines()]
        for k in "ab"
    }
    assert len(losses["a"]) == 40 and losses["a"] == losses["b"]
    trainer = make_trainer(
        RunConfig(batch=8, zero=ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True))
    )
    (sa, ma), (sb, mb) = Checkpointer(a).restore(trainer), Checkpointer(b).restore(trainer)
    assert ma["data_position"] == mb["data_position"] == 40 and int(sa.step) == 40
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
