"""Checkpoints of any state tree with orbax-checkpoint.

A checkpoint holds a pytree of arrays (typically `Trainer.init()`'s state:
the model's parameters, error-feedback residuals and other state, and the
optimizer state with its step counter), saved array by array under each
array's path, plus a JSON dict of metadata (data position, mesh shape, what
the caller adds). Each parameter keeps its own shape, so a checkpoint
restores onto any mesh: every array comes back with the sharding of the
target it is restored into. Error-feedback residuals, whose size depends on
the mesh, restart from zero on another mesh.

Orbax writes each checkpoint into a temporary directory and renames it only
once complete, so a process killed during a save leaves the previous
checkpoint as the latest.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import pathlib
import re
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from zpp_jax.errors import OutputError, UsageError

_RESIDUAL = "_zpp_residual"
_FROZEN = "_zpp_frozen"


def _codes_for_another_count(saved_mesh: dict | None, target) -> bool:
    """Whether frozen codes saved on `saved_mesh` have blocks that differ
    from `target`'s: each device's blocks follow its share, so codes fit a
    mesh of as many devices only. Their shapes may agree even so (when
    every share is whole blocks)."""
    mesh = getattr(getattr(target, "sharding", None), "mesh", None)
    if not saved_mesh or mesh is None:
        return False
    return math.prod(saved_mesh.values()) != mesh.devices.size


def _mesh_text(mesh: dict | None) -> str:
    return " x ".join(str(v) for v in mesh.values()) if mesh else "another shape"


def _flat(tree: Any) -> dict[str, Any]:
    """{path string: leaf}; an `nnx.State` by its plain nested dict."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@contextlib.contextmanager
def _errors_raised_not_logged() -> Iterator[None]:
    """Orbax logs a failed save's traceback from each of its threads before
    raising it (dozens of tracebacks for one full disk); the error raised
    is reported instead, once."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _orbax_noise_dropped() -> Iterator[None]:
    """What a failed save or restore leaves behind once its error is
    raised: the TensorStore operations still in flight complete into
    orbax's event loop, already closed, and each raises an unraisable
    ``RuntimeError: Event loop is closed``; orbax's coroutines that failed
    are reported as unraisable when dropped, or logged as "never retrieved"
    when collected. Thousands of lines, up to
    the end of the process, for an error already reported (or a damaged
    checkpoint already skipped). Inside the block exactly those are dropped
    (nothing else); after a failure, for the rest of the process, as the
    noise goes on."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        e = unraisable.exc_value
        closed = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        code = getattr(unraisable.object, "cr_code", None)  # a coroutine of orbax's, dropped
        if not (closed or (code is not None and "orbax" in code.co_filename)):
            previous(unraisable)

    never_retrieved = logging.Filter()
    never_retrieved.filter = lambda record: (
        not (
            record.getMessage().startswith("Task exception was never retrieved")
            and "orbax" in record.getMessage()
        )
    )
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(never_retrieved)
    yield  # an exception leaves both in place
    sys.unraisablehook = previous
    logging.getLogger("asyncio").removeFilter(never_retrieved)


def _cause(e: BaseException) -> str:
    """What the operating system said under `e` (a full disk, a read-only
    file system), else the first line of `e`'s message."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror} ({seen.filename})" if seen.filename else seen.strerror
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    code = re.search(r"os_error_code='?(\d+)", text)  # TensorStore's way of saying it
    if code:
        return os.strerror(int(code.group(1)))
    for number in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EFBIG, errno.EDQUOT):
        if os.strerror(number) in text:
            return os.strerror(number)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return first[:300]


# How long a failed save's temporary directory must stay deleted before
# orbax's stray writer threads are taken to be done, and the most time spent
# deleting it (`Checkpointer._discard_unfinished`).
_SETTLE_S = 0.25
_DISCARD_LIMIT_S = 10.0

# What a step directory `Checkpointer.save` wrote holds (one of them is
# left even when it is damaged).
_CHECKPOINT_ENTRIES = ("state", "meta", "_CHECKPOINT_METADATA", "commit_success.txt")


def is_checkpoint(path: pathlib.Path) -> bool:
    """Whether `path` is a step directory `Checkpointer.save` wrote (named
    by its step, holding orbax's items), complete or damaged."""
    return (
        path.name.isdigit()
        and path.is_dir()
        and any((path / entry).exists() for entry in _CHECKPOINT_ENTRIES)
    )


def check_directory(directory: pathlib.Path, what: str = "checkpoint directory") -> None:
    """Raise UsageError unless `directory` is absent or a directory whose
    entries named by a number are all checkpoints (a user's own ``2023/``
    there would be restored as a step, renamed as damaged, or deleted as an
    old checkpoint)."""
    if directory.is_symlink() and not directory.exists():
        raise UsageError(f"{what} {directory}: a symbolic link that reaches no directory (a loop?)")
    if not directory.exists():
        return
    if not directory.is_dir():
        raise UsageError(f"{what} {directory} is a file, not a directory")
    foreign = sorted(
        p.name for p in directory.iterdir() if p.name.isdigit() and not is_checkpoint(p)
    )
    if foreign:
        raise UsageError(
            f"{what} {directory} holds {', '.join(foreign)}, named like a checkpoint step but "
            "not one: move them out, or choose another directory (zpp names its checkpoints "
            "by step, and would take them for its own)"
        )


class Checkpointer:
    """Save and restore state trees under `directory`, one subdirectory per
    step; keeps the newest `max_to_keep`."""

    def __init__(self, directory: str | pathlib.Path, max_to_keep: int = 3) -> None:
        """Raises UsageError for a `directory` that is a file, or that holds
        entries named by a number that are not checkpoints (orbax would
        take them for steps: restore them, or delete them as old ones)."""
        self.directory = pathlib.Path(directory).absolute()
        if not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1:
            raise UsageError(f"max_to_keep must be a positive int, got {max_to_keep!r}")
        check_directory(self.directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def save(self, step: int, state: Any, **meta: Any) -> None:
        """Write `state` (a pytree of arrays) as checkpoint `step`, with the
        JSON-serializable `meta` (e.g. ``data_position=...``). Blocks until
        the checkpoint is complete."""
        arrays = _flat(state)
        mesh = next(
            (
                dict(a.sharding.mesh.shape)
                for a in arrays.values()
                if hasattr(getattr(a, "sharding", None), "mesh")
            ),
            None,
        )
        meta = {"step": int(step), "mesh": mesh, **meta}
        try:
            with _orbax_noise_dropped(), _errors_raised_not_logged():
                self._manager.save(
                    int(step),
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                    ),
                    force=True,
                )
                self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - any failure to write is reported the same way
            with _errors_raised_not_logged(), contextlib.suppress(Exception):
                self._manager.close()
            self._discard_unfinished(step)
            raise OutputError(
                f"checkpoint {step} could not be written to {self.directory}: {_cause(e)}; "
                "the checkpoints before it are intact"
            ) from e

    def _discard_unfinished(self, step: int) -> None:
        """Delete what a failed save of `step` left (orbax's temporary
        directory, never renamed into place), so that its space is free
        again. Process 0 deletes; every process goes on at once.

        A failed save leaves orbax's writer threads behind (its metadata
        writer, a write already queued), which may add a file to the
        directory while it is deleted, or just after. So it is deleted until
        it has stayed absent for `_SETTLE_S`, for at most `_DISCARD_LIMIT_S`:
        the cost is that pause, on the failure path only."""
        if jax.process_index() != 0:
            return
        pattern = f"{int(step)}.orbax-checkpoint-tmp*"
        deadline = time.monotonic() + _DISCARD_LIMIT_S
        while time.monotonic() < deadline:
            partials = list(self.directory.glob(pattern))
            for partial in partials:
                shutil.rmtree(partial, ignore_errors=True)
            if not partials:
                time.sleep(_SETTLE_S)
                if not any(self.directory.glob(pattern)):
                    return

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    @staticmethod
    def steps_in(directory: str | pathlib.Path) -> list[int]:
        """The checkpoints in `directory` (`is_checkpoint`), in order; read
        without creating the directory (none if it does not exist)."""
        folder = pathlib.Path(directory)
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if is_checkpoint(p))

    @staticmethod
    def saved_mesh(directory: str | pathlib.Path, step: int | None = None) -> dict | None:
        """The mesh shape ({"node": n, "local": l}) checkpoint `step`
        (default: the newest) was saved on, read from its metadata file
        alone, before any device is touched (a command can then emulate
        that many CPU devices); None if there is no such checkpoint."""
        steps = Checkpointer.steps_in(directory)
        step = (steps[-1] if steps else None) if step is None else step
        file = pathlib.Path(directory) / str(step) / "meta" / "metadata"
        if step is None or not file.is_file():
            return None
        try:
            return json.loads(file.read_text()).get("mesh")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def set_aside(self, step: int) -> pathlib.Path:
        """Rename checkpoint `step` to ``<step>.damaged`` (``.damaged-2``, ...
        if taken), so that it is kept but no longer counts as a checkpoint
        and the step can be saved again. Process 0 renames; every process
        waits for it. Returns the new path."""
        source = self.directory / str(step)
        target = self.directory / f"{step}.damaged"
        k = 1
        while target.exists():
            k += 1
            target = self.directory / f"{step}.damaged-{k}"
        if jax.process_index() == 0:
            source.rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"zpp-set-aside-{step}")
        self._manager.reload()
        return target

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of checkpoint `step` (no arrays are read)."""
        with _orbax_noise_dropped(), _errors_raised_not_logged():
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        return restored["meta"]

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Checkpoint `step` (default: the latest) restored into the structure
        of `target` (a pytree of arrays or `jax.ShapeDtypeStruct`s with
        shardings, e.g. the current state): every array comes back with the
        target's sharding, on whatever mesh that is. Error-feedback
        residuals saved on a mesh of another shape restart from zero
        (``meta["residuals_reset"]``).

        Raises:
          UsageError: no checkpoint, or one whose arrays do not fit `target`
            (another model).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise UsageError(f"no checkpoint found in {self.directory}")
        meta = self.read_meta(step)
        saved = self._manager.item_metadata(step)["state"]
        wanted = _flat(target)
        missing = sorted(set(wanted) - set(saved))
        if missing:
            raise UsageError(
                f"checkpoint {step} in {self.directory} has no {missing[:3]}: it is of another "
                "model or optimizer (a state of another layout, such as one an older zpp-jax "
                "saved)"
            )
        host = SingleDeviceSharding(jax.devices()[0])
        request, reset = {}, []
        for key, t in wanted.items():
            shape = tuple(saved[key].shape)
            if _FROZEN in key and _codes_for_another_count(meta.get("mesh"), t):
                shape = None  # the same bytes, cut into other blocks
            if shape == tuple(np.shape(t)) and getattr(t, "sharding", None) is None:
                request[key] = np.zeros(np.shape(t), np.result_type(t))  # a host array
            elif shape == tuple(np.shape(t)):
                request[key] = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding)
            elif _RESIDUAL in key:
                request[key] = jax.ShapeDtypeStruct(shape, t.dtype, sharding=host)
                reset.append(key)
            elif _FROZEN in key:
                raise UsageError(
                    f"checkpoint {step} in {self.directory} holds frozen weights stored as codes "
                    f"for a mesh of {_mesh_text(meta.get('mesh'))}, whose blocks differ on "
                    "this one: restore it on a mesh of that shape"
                )
            else:
                raise UsageError(
                    f"checkpoint {step} holds {key} with shape {shape}, the target has "
                    f"{tuple(np.shape(t))}: it is of another model"
                )
        for key in set(saved) - set(wanted):  # read and dropped: the target has no use for it
            meta_key = saved[key]
            request[key] = jax.ShapeDtypeStruct(
                tuple(meta_key.shape), meta_key.dtype, sharding=host
            )
        with _orbax_noise_dropped(), _errors_raised_not_logged():
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(request))
            )["state"]
        for key in reset:
            t = wanted[key]
            restored[key] = jax.device_put(np.zeros(t.shape, t.dtype), t.sharding)
        meta["residuals_reset"] = bool(reset)
        leaves = [restored[key] for key in wanted]
        if isinstance(target, nnx.State):
            out = jax.tree.unflatten(jax.tree.structure(nnx.to_pure_dict(target)), leaves)
            state = jax.tree.map(lambda x: x, target)
            nnx.replace_by_pure_dict(state, out)
            return state, meta
        return jax.tree.unflatten(jax.tree.structure(target), leaves), meta
