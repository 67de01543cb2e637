import os
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from zpp_jax import GPT, Checkpointer, GPTConfig, Trainer, ZeroPPConfig, make_mesh, nnx_parts

CFG = GPTConfig.preset("tiny", seq_len=16, n_layers=2)


EF = ZeroPPConfig(error_feedback=True)


def _trainer(shape, config=EF, cfg=CFG):
    devices = jax.devices()[: shape[0] * shape[1]]
    mesh = make_mesh(*shape, devices=devices)
    return Trainer(nnx_parts(GPT(cfg, nnx.Rngs(0))), optax.adamw(1e-2), mesh, config)


def _trained(trainer, steps=2):
    tok = np.random.default_rng(3).integers(0, 256, (16, CFG.seq_len + 1), dtype=np.int32)
    batch = jax.device_put({"inputs": tok[:, :-1], "targets": tok[:, 1:]}, trainer.batch_sharding())
    state = trainer.init()
    for _ in range(steps):
        state, _ = trainer.step(state, batch)
    return state


def _equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


@pytest.fixture(scope="module")
def trained():
    """A 2 x 4 ZeRO++ trainer with error feedback, after 2 steps (not to be stepped again)."""
    tr = _trainer((2, 4))
    return tr, _trained(tr)


def test_same_mesh_restores_every_array_bitwise(tmp_path, trained):
    tr, state = trained
    ck = Checkpointer(tmp_path)
    ck.save(tr, state, data_position=5)
    restored, meta = ck.restore(_trainer((2, 4)))
    assert meta["data_position"] == 5 and meta["step"] == 2 and not meta["residuals_reset"]
    assert _equal(restored, state)
    assert np.any(np.asarray(state.residuals["blocks"]) != 0)  # residuals restored, not zeros
    assert restored.params["blocks"].sharding == state.params["blocks"].sharding


@pytest.mark.parametrize("shape", [(4, 2), (1, 4)])
def test_restores_on_another_mesh(tmp_path, trained, shape):
    tr, state = trained
    Checkpointer(tmp_path).save(tr, state, data_position=2)
    other = _trainer(shape)
    restored, meta = Checkpointer(tmp_path).restore(other)
    assert _equal(other.export(restored), tr.export(state))
    # the optimizer moments follow the parameters
    mu = lambda t, s: t.export(s._replace(params=s.opt_state[0].mu))  # noqa: E731
    assert _equal(mu(other, restored), mu(tr, state))
    assert meta["residuals_reset"] and int(restored.step) == 2
    assert all(np.all(np.asarray(r) == 0) for r in jax.tree.leaves(restored.residuals))
    n = shape[0] * shape[1]
    restored, m = other.step(
        restored,
        jax.device_put(
            {"inputs": np.zeros((n, 16), np.int32), "targets": np.zeros((n, 16), np.int32)},
            other.batch_sharding(),
        ),
    )
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0 and int(restored.step) == 3


_KILLED_SAVE = """
import os, sys, asyncio
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
import jax, numpy as np, optax
from flax import nnx
from orbax.checkpoint._src.path import atomicity
from zpp_jax import GPT, Checkpointer, GPTConfig, Trainer, ZeroPPConfig, make_mesh, nnx_parts

cfg = GPTConfig.preset("tiny", seq_len=16, n_layers=2)
tr = Trainer(nnx_parts(GPT(cfg, nnx.Rngs(0))), optax.adamw(1e-2), make_mesh(2, 4),
             ZeroPPConfig(error_feedback=True))
ck = Checkpointer(sys.argv[1])
state = tr.init()
ck.save(tr, state._replace(step=state.step + 1), data_position=1)

async def hang(self, *args, **kwargs):  # every file of step 2 written, not yet committed
    print("HALF-WAY", flush=True)
    await asyncio.sleep(3600)

atomicity.AtomicRenameTemporaryPath.finalize = hang
bumped = jax.tree.map(lambda a: a + 1, state.params)
ck.save(tr, state._replace(step=state.step + 2, params=bumped), data_position=2)
"""


@pytest.mark.slow
def test_save_killed_half_way_keeps_the_previous_checkpoint(tmp_path):
    """A process SIGKILLed in the middle of writing checkpoint 2 (its files
    written, not yet committed): a new process finds checkpoint 1 as the
    latest, restores it bit for bit, and can write checkpoint 2 again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZPP_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()  # blocks until the save is half-way (or the child died)
        assert line.strip() == "HALF-WAY", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.glob("2.orbax-checkpoint-tmp*"))  # step 2 was on disk, uncommitted
    tr = _trainer((2, 4))
    ck = Checkpointer(tmp_path)
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    restored, meta = ck.restore(tr)
    init = tr.init()
    assert meta["data_position"] == 1 and int(restored.step) == 1
    assert _equal(restored.params, init.params) and _equal(restored.opt_state, init.opt_state)
    ck.save(tr, init._replace(step=init.step + 2), data_position=2)
    assert Checkpointer(tmp_path).latest_step() == 2


def test_errors(tmp_path, trained):
    tr, state = trained
    with pytest.raises(ValueError, match="no checkpoint found"):
        Checkpointer(tmp_path / "empty").restore(tr)
    Checkpointer(tmp_path).save(tr, state, 0)
    bigger = _trainer((2, 4), cfg=GPTConfig.preset("tiny", seq_len=16, n_layers=2, d_ff=128))
    with pytest.raises(ValueError, match="another model"):
        Checkpointer(tmp_path).restore(bigger)


def test_restores_across_layout_alignments(tmp_path, trained):
    """A ZeRO++ checkpoint (tensors aligned to quantization blocks, error
    feedback) restores into a ZeRO-3 trainer (no alignment, no residuals)."""
    tr, state = trained
    Checkpointer(tmp_path).save(tr, state, 2)
    z3 = _trainer((2, 4), config=ZeroPPConfig.zero3())
    assert z3.layouts["blocks"].offsets != tr.layouts["blocks"].offsets
    restored, meta = Checkpointer(tmp_path).restore(z3)
    assert _equal(z3.export(restored), tr.export(state)) and restored.residuals is None
    mu = lambda t, s: t.export(s._replace(params=s.opt_state[0].mu))  # noqa: E731
    assert _equal(mu(z3, restored), mu(tr, state))
