"""Checkpoints of a `TrainState` with orbax-checkpoint.

A checkpoint holds the fp32 primary shards, the optimizer state, the
error-feedback residuals, the step, the data position and what is needed to
restore onto another mesh. Orbax writes each checkpoint into a temporary
directory and renames it only once complete, so a crash during a save leaves
the previous checkpoint as the latest usable one.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from zpp_jax.errors import UsageError
from zpp_jax.mesh import mesh_shape
from zpp_jax.train import GROUPS, Trainer, TrainState


class Checkpointer:
    """Save and restore `TrainState`s under `directory` (one subdirectory per step).

    Keeps the newest `max_to_keep` checkpoints.
    """

    def __init__(self, directory: str | pathlib.Path, max_to_keep: int = 3) -> None:
        self.directory = pathlib.Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def save(
        self, trainer: Trainer, state: TrainState, data_position: int, extra: dict | None = None
    ) -> int:
        """Write `state` as checkpoint number `state.step`; returns that step.

        `data_position` is the number of batches the run has consumed (skipped
        steps included), so that a resumed run draws the next batch.
        """
        step = int(state.step)
        nodes, local = mesh_shape(trainer.mesh)
        meta = {
            "step": step,
            "data_position": int(data_position),
            "mesh": [nodes, local],
            "layouts": {
                g: {
                    "padded_size": layout.padded_size,
                    "offsets": list(layout.offsets),
                    "sizes": list(layout.sizes),
                }
                for g, layout in trainer.layouts.items()
            },
            "error_feedback": trainer.config.error_feedback,
            "residual_dtype": trainer.config.residual_dtype,
            "num_layers": trainer.num_layers,
            **(extra or {}),
        }
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self._manager.wait_until_finished()
        return step

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, trainer: Trainer, step: int | None = None) -> tuple[TrainState, dict]:
        """Restore checkpoint `step` (default: the latest) for `trainer`.

        On the mesh it was saved from, every array comes back as it was, bit
        for bit, sharded for `trainer`. On another mesh (another device count
        or node x local split) or another flat layout (e.g. another
        quantization alignment) each tensor of the parameters and optimizer
        state is moved to its new place; the error-feedback residuals, which
        belong to a mesh's reduction order, restart from zero
        (`meta["residuals_reset"]`).

        Raises:
          ValueError: no checkpoint, or one of another model.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise UsageError(f"no checkpoint found in {self.directory}")
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        target = trainer.abstract_state()
        same_layout = True
        for g, layout in trainer.layouts.items():
            saved = meta["layouts"][g]
            if saved["sizes"] != list(layout.sizes):
                raise UsageError(
                    f"checkpoint {step} holds a {g} with tensors of {saved['sizes']} elements, "
                    f"the model has {list(layout.sizes)}: it is of another model"
                )
            same_layout &= saved["offsets"] == list(layout.offsets)
            same_layout &= saved["padded_size"] == layout.padded_size
        same_mesh = meta["mesh"] == list(mesh_shape(trainer.mesh))
        if same_mesh and same_layout and meta["error_feedback"] == trainer.config.error_feedback:
            state = self._restore_state(step, target)
            meta["residuals_reset"] = False
            return state, meta
        state = self._restore_remapped(step, trainer, target, meta)
        meta["residuals_reset"] = trainer.config.error_feedback
        return state, meta

    def _restore_state(self, step: int, target: Any) -> TrainState:
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )["state"]
        return TrainState(*restored)

    def _restore_remapped(self, step, trainer: Trainer, target: TrainState, meta) -> TrainState:
        old_nodes, old_local = meta["mesh"]
        old_n = old_nodes * old_local
        host = SingleDeviceSharding(jax.devices()[0])

        def old_shape(path, leaf):
            g = _group(path)
            if g is None or not leaf.shape:
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=host)
            old_padded = meta["layouts"][g]["padded_size"]
            return jax.ShapeDtypeStruct(leaf.shape[:-1] + (old_padded,), leaf.dtype, sharding=host)

        old_target = target._replace(
            params=jax.tree_util.tree_map_with_path(old_shape, target.params),
            opt_state=jax.tree_util.tree_map_with_path(old_shape, target.opt_state),
            residuals=None,
        )
        if meta["error_feedback"]:
            old_target = old_target._replace(residuals=self._old_residuals(meta, old_n, host))
        old = self._restore_state(step, old_target)

        def remap(path, leaf, new):
            g = _group(path)
            arr = np.asarray(leaf)
            if g is not None and arr.ndim:
                out = np.zeros(arr.shape[:-1] + (new.shape[-1],), arr.dtype)
                old_offsets = meta["layouts"][g]["offsets"]
                layout = trainer.layouts[g]
                for o, n, size in zip(old_offsets, layout.offsets, layout.sizes, strict=True):
                    out[..., n : n + size] = arr[..., o : o + size]
                arr = out
            return jax.device_put(arr.astype(new.dtype), new.sharding)

        params = jax.tree_util.tree_map_with_path(remap, old.params, target.params)
        opt_state = jax.tree_util.tree_map_with_path(remap, old.opt_state, target.opt_state)
        residuals = None
        if trainer.config.error_feedback:
            residuals = jax.tree.map(
                lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding), target.residuals
            )
        step_arr = jax.device_put(np.asarray(old.step), target.step.sharding)
        return TrainState(step_arr, params, opt_state, residuals)

    @staticmethod
    def _old_residuals(meta, old_n, host):
        from zpp_jax.collectives import residual_size

        nodes, local = meta["mesh"]
        out = {}
        for g in GROUPS:
            s = meta["layouts"][g]["padded_size"] // old_n
            shape = (old_n * residual_size(s, nodes, local),)
            if g == "blocks":
                shape = (meta["num_layers"],) + shape
            out[g] = jax.ShapeDtypeStruct(shape, meta["residual_dtype"], sharding=host)
        return out


def _group(path) -> str | None:
    for key in path:
        name = getattr(key, "key", None)
        if name in GROUPS:
            return name
    return None
