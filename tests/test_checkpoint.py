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
    tok = jax.random.randint(jax.random.key(3), (16, CFG.seq_len + 1), 0, 256)
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


def test_same_mesh_restores_every_array_bitwise(tmp_path):
    tr = _trainer((2, 4))
    state = _trained(tr)
    ck = Checkpointer(tmp_path)
    ck.save(tr, state, data_position=5)
    restored, meta = ck.restore(_trainer((2, 4)))
    assert meta["data_position"] == 5 and meta["step"] == 2 and not meta["residuals_reset"]
    assert _equal(restored, state)
    assert restored.params["blocks"].sharding == state.params["blocks"].sharding


@pytest.mark.parametrize("shape", [(4, 2), (1, 4)])
def test_restores_on_another_mesh(tmp_path, shape):
    tr = _trainer((2, 4))
    state = _trained(tr)
    Checkpointer(tmp_path).save(tr, state, data_position=2)
    other = _trainer(shape)
    restored, meta = Checkpointer(tmp_path).restore(other)
    assert _equal(other.export(restored), tr.export(state))
    # the optimizer moments follow the parameters
    mu = lambda t, s: t.export(s._replace(params=s.opt_state[0].mu))  # noqa: E731
    assert _equal(mu(other, restored), mu(tr, state))
    assert meta["residuals_reset"] and int(restored.step) == 2
    assert all(np.all(np.asarray(r) == 0) for r in jax.tree.leaves(restored.residuals))
    restored, m = other.step(
        restored,
        jax.device_put(
            {"inputs": np.zeros((8, 16), np.int32), "targets": np.zeros((8, 16), np.int32)},
            other.batch_sharding(),
        ),
    )
    assert np.isfinite(float(m["loss"]))


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    tr = _trainer((2, 4))
    state = _trained(tr, 1)
    ck = Checkpointer(tmp_path)
    ck.save(tr, state, data_position=1)
    state2 = _trained(tr, 2)
    with pytest.raises(TypeError):  # dies half-way: the metadata cannot be written
        ck.save(tr, state2, data_position=2, extra={"unserializable": object()})
    ck = Checkpointer(tmp_path)  # a new process looking at the directory
    assert ck.latest_step() == 1
    restored, meta = ck.restore(_trainer((2, 4)))
    assert meta["data_position"] == 1 and _equal(restored, state)
    ck.save(tr, state2, data_position=2)
    assert ck.latest_step() == 2


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint found"):
        Checkpointer(tmp_path / "empty").restore(_trainer((2, 4)))
    tr = _trainer((2, 4))
    Checkpointer(tmp_path).save(tr, tr.init(), 0)
    bigger = _trainer((2, 4), cfg=GPTConfig.preset("tiny", seq_len=16, n_layers=2, d_ff=128))
    with pytest.raises(ValueError, match="another model"):
        Checkpointer(tmp_path).restore(bigger)


def test_restores_across_layout_alignments(tmp_path):
    """A ZeRO-3 checkpoint (no alignment) restores into a ZeRO++ trainer (blocks aligned)."""
    z3 = _trainer((2, 4), config=ZeroPPConfig.zero3())
    state = _trained(z3)
    Checkpointer(tmp_path).save(z3, state, 2)
    zpp = _trainer((2, 4), config=ZeroPPConfig())
    assert zpp.layouts["blocks"].offsets != z3.layouts["blocks"].offsets
    restored, _ = Checkpointer(tmp_path).restore(zpp)
    assert _equal(zpp.export(restored), z3.export(state))
