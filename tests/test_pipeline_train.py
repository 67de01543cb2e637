"""`zpp train --stages K`: training through the token pipeline, against
`zpp train` without it; checkpoints, the gathers it compiles, bad input."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from stopped_run import copy_stopped_after

from zpp_jax import Checkpointer, UsageError, ZeroPPConfig
from zpp_jax.analysis import collectives_in_hlo
from zpp_jax.lowlevel import make_pipeline_mesh
from zpp_jax.models.gpt import GPT, GPTConfig
from zpp_jax.pipeline import PipelineTrainer, TokenPipeline
from zpp_jax.recipes import RunConfig, run
from zpp_jax.recipes.config import parse_slices
from zpp_jax.recipes.train import make_pipeline_trainer

EXACT = ZeroPPConfig.zero3(comm_dtype=None)
# Tiny GPT (2 layers: one per stage) at 16 tokens, fp32, 8 sequences.
BASE = RunConfig(
    zero=EXACT,
    seq_len=16,
    batch=8,
    steps=5,
    eval_every=5,
    eval_batches=1,
    warmup=1,
    compute_dtype="float32",
    progress=False,
)
PIPE = dict(stages=2, nodes=2, local=2, slices="4,4,8")


def _losses(records):
    return np.array([r["loss"] for r in records])


@pytest.fixture(scope="module")
def reference():
    """`zpp train` on a 2 x 4 mesh, no pipeline."""
    return run(BASE)


# Pipelined exactness stays in the loop (test_pipeline_runtime).
@pytest.mark.slow
@pytest.mark.parametrize(
    "stage_zero",
    [True, False],
    ids=["zero3", "replicated"],
)
def test_pipelined_training_equals_unpipelined(reference, stage_zero):
    """Same seed, data and batch: the losses (and the validation loss) of
    the pipelined run equal the unpipelined run's to 1e-5 relative, with
    ZeRO-3 inside the stages and with the layers replicated there."""
    got = run(dataclasses.replace(BASE, stage_zero=stage_zero, **PIPE))
    np.testing.assert_allclose(_losses(got), _losses(reference), rtol=1e-5)
    assert got[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], rel=1e-5)
    assert [r["skipped"] for r in got] == [0] * 5


@pytest.mark.slow  # the GPT's case (test_pipelined_training_equals_unpipelined) stays in the loop
def test_pipelined_llama_training_equals_unpipelined():
    """`--arch llama` (rotary positions, grouped key/value heads, its layers
    a Python list) through 2 stages with ZeRO-3 inside them: the losses and
    the validation loss equal the unpipelined run's to 1e-5 relative."""
    llama = dataclasses.replace(BASE, arch="llama")
    want = run(llama)
    got = run(dataclasses.replace(llama, **PIPE))
    np.testing.assert_allclose(_losses(got), _losses(want), rtol=1e-5)
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_resume_of_a_pipelined_run_is_bitwise(tmp_path):
    """ZeRO++ with error feedback inside the stages (the residuals are part
    of the state): a run stopped after checkpoint 1 and resumed by a new run
    ends with the metrics and the state of a run never stopped, bit for bit."""
    zero = ZeroPPConfig(error_feedback=True)
    cfg = dataclasses.replace(BASE, zero=zero, steps=2, eval_every=1, **PIPE)

    def train(name, steps, resume=False):
        out = dict(ckpt_dir=str(tmp_path / name), metrics=str(tmp_path / f"{name}.jsonl"))
        out["ckpt_every"] = 1
        return run(dataclasses.replace(cfg, steps=steps, resume=resume, **out))

    train("a", 2)
    # b: run a as it was when stopped after checkpoint 1 (its directory and
    # its metrics then), resumed by a new run
    copy_stopped_after(
        1, tmp_path / "a", tmp_path / "a.jsonl", tmp_path / "b", tmp_path / "b.jsonl"
    )
    assert [r["step"] for r in train("b", 2, resume=True)] == [2]
    records = {
        k: [json.loads(x) for x in (tmp_path / f"{k}.jsonl").read_text().splitlines()] for k in "ab"
    }
    for key in ("step", "loss", "grad_norm", "val_loss"):
        assert [r.get(key) for r in records["a"]] == [r.get(key) for r in records["b"]], key
    target = make_pipeline_trainer(cfg, (4, 4, 8)).abstract_state()
    (sa, ma), (sb, mb) = (Checkpointer(tmp_path / k).restore(target) for k in "ab")
    assert ma["data_position"] == mb["data_position"] == 2
    assert PipelineTrainer.steps_done(sa) == 2 and "residuals" in sa
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


CFG4 = GPTConfig(seq_len=32, d_model=32, n_layers=4, n_heads=4, d_ff=64, dtype="float32")


@pytest.mark.slow  # a compiled training step of its own
def test_a_layer_is_gathered_once_per_training_step():
    """ZeRO++ inside 2 stages of 2 nodes x 2, 4 slices (M + K - 1 = 5
    pipeline steps): in the compiled gradient step every all-gather runs
    once per layer of the stage (layers/K times, not 5 times that): the
    cross-node int8 gather (one message: codes, then scales) once per layer
    in the forward pass, the node's local gather once, and no gather in the
    backward pass.
    The gradient's all-to-alls (qgZ) also run once per layer."""
    pipe = TokenPipeline(
        GPT(CFG4, nnx.Rngs(0)), make_pipeline_mesh(2, 2, 2), (8, 8, 8, 8), zero=ZeroPPConfig()
    )
    tokens = jnp.zeros((4, CFG4.seq_len), jnp.int32)
    hlo = pipe.value_and_grad.lower(pipe.params(), tokens, tokens).compile().as_text()
    cs = collectives_in_hlo(hlo)
    per_stage = CFG4.n_layers // 2
    gathers = [c for c in cs if c.kind == "all-gather"]
    cross = [c for c in gathers if c.spans_nodes(2)]
    assert len(cross) == 1 and cross[0].dtypes[0] == "u8"  # codes and scales, as bytes
    assert all(c.runs == per_stage for c in gathers)
    assert sum(c.runs for c in cross) / per_stage == 1  # one gather per layer
    assert all(c.runs == per_stage for c in cs if c.kind == "all-to-all")


def test_slices_auto_plans_for_the_model(tmp_path):
    """`--slices auto` plans the run's model with the lockstep objective,
    from the analytic cost model (the Llama's matmul weights counted) or a
    cost file, and says which; a count cuts equal slices."""
    from zpp_jax.pipeline import FittedCost, save_cost
    from zpp_jax.recipes.train import choose_slices, model_config

    for arch in ("gpt", "llama"):
        cfg = dataclasses.replace(BASE, arch=arch, stages=2, seq_len=64, batch=4, nodes=1)
        slices, how = choose_slices(cfg, model_config(cfg))
        assert sum(slices) == 64 and how == "planned (analytic cost model, granularity 1 tokens)"
    # Times that make slicing pay: a per-slice overhead, little for context.
    lengths = [1, 2, 4, 8, 16, 32, 64]
    times = tuple(5e-5 + 1e-5 * n for n in lengths)
    cost = FittedCost(1, tuple(lengths), times, coef=(0.0, 0.0, 1e-7))
    save_cost(cost, tmp_path / "cost.json")
    cfg = dataclasses.replace(cfg, cost=str(tmp_path / "cost.json"))
    slices, how = choose_slices(cfg, model_config(cfg))
    assert sum(slices) == 64 and how.startswith(f"planned (cost model {tmp_path}")
    assert slices == (16, 16, 16, 16)
    assert choose_slices(dataclasses.replace(cfg, slices="4"), model_config(cfg)) == (
        (16, 16, 16, 16),
        "4 equal slices",
    )


def test_bad_pipeline_input_is_refused():
    for text in ("0", "4,-4", "a", "", "4,,4"):
        with pytest.raises(UsageError, match="--slices"):
            parse_slices(text)
    assert parse_slices("4") == 4 and parse_slices("4,12") == (4, 12)
    with pytest.raises(UsageError, match="--grad-accum"):
        RunConfig(grad_accum=2, stages=2)
    with pytest.raises(UsageError, match="--stages K"):
        RunConfig(slices="4")
    with pytest.raises(UsageError, match="stages"):
        RunConfig(stages=0)
    with pytest.raises(UsageError, match="add up to 12 tokens; the sequences have 16"):
        run(dataclasses.replace(BASE, stages=2, nodes=2, local=2, slices="4,8"))
    with pytest.raises(UsageError, match="more slices than the 16 tokens"):
        run(dataclasses.replace(BASE, stages=2, nodes=2, local=2, slices="17"))
    with pytest.raises(UsageError, match="does not divide the model's 2 layers"):
        run(dataclasses.replace(BASE, stages=4, nodes=1, local=2))
    with pytest.raises(UsageError, match=r"2 x 2 x 4 = 16 does not match the 8 devices"):
        run(dataclasses.replace(BASE, stages=2))


@pytest.mark.slow
@pytest.mark.parametrize(
    "local, inside",
    [(4, ["--zero3", "--comm-dtype", "float32"]), (1, ["--no-stage-zero"])],
    ids=["zero3-over-4-devices", "one-device-per-stage"],
)
def test_two_processes_one_stage_each_equal_one(reference, tmp_path, local, inside):
    """`zpp launch --nodes 2 -- train --stages 2`: each process is a stage
    of `local` devices (ZeRO-3 over 4, or the layers whole on one, as
    `benchmarks/terapipe/run.py` runs it), the activations cross between
    the processes; the losses equal the single-process unpipelined run's."""
    metrics = tmp_path / "m.jsonl"
    args = ["launch", "--nodes", "2", "--local", str(local), "--", "train", "--quiet"]
    args += ["--stages", "2", *inside, "--compute-dtype", "float32"]
    args += ["--seq", "16", "--batch", "8", "--steps", "5", "--eval-every", "5"]
    args += ["--eval-batches", "1", "--warmup", "1", "--slices", "4,4,8"]
    args += ["--metrics", str(metrics)]
    out = subprocess.run(
        [sys.executable, "-m", "zpp_jax", *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line) for line in pathlib.Path(metrics).read_text().splitlines()]
    np.testing.assert_allclose(_losses(got), _losses(reference), rtol=1e-5)
