import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from zpp_jax import Checkpointer, Trainer, ZeroPPConfig, make_mesh
from zpp_jax.models import GPT, GPTConfig

CFG = GPTConfig.preset("tiny", seq_len=16, n_layers=2)


EF = ZeroPPConfig(error_feedback=True)


def _trainer(shape, config=EF, cfg=CFG, optimizer=None):
    devices = jax.devices()[: shape[0] * shape[1]]
    mesh = make_mesh(*shape, devices=devices)
    return Trainer(GPT(cfg, nnx.Rngs(0)), optimizer or optax.adamw(1e-2), mesh, config)


def _trained(trainer, steps=2):
    tok = np.random.default_rng(3).integers(0, 256, (16, CFG.seq_len + 1), dtype=np.int32)
    batch = jax.device_put({"inputs": tok[:, :-1], "targets": tok[:, 1:]}, trainer.batch_sharding())
    state = trainer.init()
    for _ in range(steps):
        state, _ = trainer.train_step(state, batch)
    return state


def _arrays(state, residuals=False):
    """{path: array} of a state, error-feedback residuals left out unless asked."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in flat
        if residuals or "_zpp_residual" not in jax.tree_util.keystr(p)
    }


def _equal(a, b, residuals=False):
    a, b = _arrays(a, residuals), _arrays(b, residuals)
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained():
    """A 2 x 4 ZeRO++ trainer with error feedback, after 2 steps (not to be stepped again)."""
    tr = _trainer((2, 4))
    return tr, _trained(tr)


def test_same_mesh_restores_every_array_bitwise(tmp_path, trained):
    tr, state = trained
    ck = Checkpointer(tmp_path)
    ck.save(2, state, data_position=5)
    restored, meta = ck.restore(_trainer((2, 4)).abstract_state())
    assert meta["data_position"] == 5 and meta["step"] == 2 and not meta["residuals_reset"]
    assert meta["mesh"] == {"node": 2, "local": 4}
    assert _equal(restored, state, residuals=True)
    residual = state[0]["blocks"]["_zpp_residual"].get_value()
    assert np.any(np.asarray(residual) != 0)  # residuals restored, not zeros
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.slow  # the same mesh restores bitwise in the loop
@pytest.mark.parametrize("shape", [(4, 2), (1, 4)])
def test_restores_on_another_mesh(tmp_path, trained, shape):
    """Parameters and optimizer moments come back in their own shapes on the
    new mesh; the residuals, sized for the old mesh, restart from zero."""
    tr, state = trained
    Checkpointer(tmp_path).save(2, state, data_position=2)
    other = _trainer(shape)
    restored, meta = Checkpointer(tmp_path).restore(other.abstract_state())
    assert _equal(restored, state)
    assert meta["residuals_reset"] and Trainer.steps_done(restored) == 2
    residuals = [v for k, v in _arrays(restored, True).items() if "_zpp_residual" in k]
    assert residuals and all(np.all(r == 0) for r in residuals)
    n = shape[0] * shape[1]
    restored, m = other.train_step(
        restored,
        jax.device_put(
            {"inputs": np.zeros((n, 16), np.int32), "targets": np.zeros((n, 16), np.int32)},
            other.batch_sharding(),
        ),
    )
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0
    assert Trainer.steps_done(restored) == 3


def test_any_state_tree(tmp_path, mesh24):
    """Not only a Trainer's state: a dict of arrays, each restored with the
    target's sharding."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tree = {
        "w": jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh24, P("node"))),
        "step": np.int32(7),
        "nested": [np.ones(3, np.float16)],
    }
    Checkpointer(tmp_path).save(7, tree, note="hello")
    target = {
        "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh24, P())),
        "step": np.int32(0),
        "nested": [np.zeros(3, np.float16)],
    }
    restored, meta = Checkpointer(tmp_path).restore(target)
    assert meta["note"] == "hello" and int(restored["step"]) == 7
    np.testing.assert_array_equal(restored["w"], tree["w"])
    assert restored["w"].sharding == NamedSharding(mesh24, P())
    np.testing.assert_array_equal(restored["nested"][0], tree["nested"][0])


_KILLED_SAVE = """
import os, sys, asyncio
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
import jax, numpy as np, optax
from flax import nnx
from orbax.checkpoint._src.path import atomicity
from zpp_jax import Checkpointer, Trainer, ZeroPPConfig, make_mesh
from zpp_jax.models import GPT, GPTConfig

cfg = GPTConfig.preset("tiny", seq_len=16, n_layers=2)
tr = Trainer(GPT(cfg, nnx.Rngs(0)), optax.adamw(1e-2), make_mesh(2, 4),
             ZeroPPConfig(error_feedback=True))
ck = Checkpointer(sys.argv[1])
state = tr.init()
ck.save(1, state, data_position=1)

async def hang(self, *args, **kwargs):  # every file of step 2 written, not yet committed
    print("HALF-WAY", flush=True)
    await asyncio.sleep(3600)

atomicity.AtomicRenameTemporaryPath.finalize = hang
ck.save(2, jax.tree.map(lambda a: a + 1, state), data_position=2)
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
    restored, meta = ck.restore(tr.abstract_state())
    assert meta["data_position"] == 1
    assert _equal(restored, tr.init(), residuals=True)
    ck.save(2, tr.init(), data_position=2)
    assert Checkpointer(tmp_path).latest_step() == 2


def test_errors(tmp_path, trained):
    tr, state = trained
    with pytest.raises(ValueError, match="no checkpoint found"):
        Checkpointer(tmp_path / "empty").restore(tr.abstract_state())
    Checkpointer(tmp_path).save(0, state)
    bigger = _trainer((2, 4), cfg=GPTConfig.preset("tiny", seq_len=16, n_layers=2, d_ff=128))
    with pytest.raises(ValueError, match="another model"):
        Checkpointer(tmp_path).restore(bigger.abstract_state())
    # an optimizer that keeps more state (its hyperparameters)
    injected = _trainer((2, 4), optimizer=optax.inject_hyperparams(optax.adamw)(1e-2))
    with pytest.raises(ValueError, match=r"has no .*'hyperparams'.*another model or optimizer"):
        Checkpointer(tmp_path).restore(injected.abstract_state())


def test_a_failed_save_is_deleted_even_when_a_writer_adds_to_it_late(tmp_path):
    """What a failed save left is gone, although a writer thread of that
    save (orbax's metadata writer) puts a file back into it after the first
    deletion, as it did on a full disk."""
    partial = tmp_path / "4.orbax-checkpoint-tmp-1"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "d").write_bytes(b"x" * 1000)
    ck = Checkpointer(tmp_path)
    put_back = threading.Event()

    def late_writer():
        while partial.exists():
            time.sleep(0.001)
        partial.mkdir()
        (partial / "_CHECKPOINT_METADATA").write_text("{}")
        put_back.set()

    writer = threading.Thread(target=late_writer)
    writer.start()
    ck._discard_unfinished(4)
    writer.join()
    assert put_back.is_set()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_restores_across_configurations(tmp_path, trained):
    """A ZeRO++ checkpoint with error feedback restores into a ZeRO-3 trainer
    (no residuals): the parameters and optimizer state are the same arrays."""
    tr, state = trained
    Checkpointer(tmp_path).save(2, state)
    z3 = _trainer((2, 4), config=ZeroPPConfig.zero3())
    restored, _ = Checkpointer(tmp_path).restore(z3.abstract_state())
    assert not any("_zpp_residual" in k for k in _arrays(restored, True))
    assert _equal(restored, state)
