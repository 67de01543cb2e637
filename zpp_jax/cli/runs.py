"""What keeps a `zpp train` run from being lost or confused with another.

* `check_paths`: every path a run reads or writes is checked before anything
  is built or compiled (data readable, metrics and checkpoint locations
  writable and of the right kind).
* `identity`: what makes two runs the same run (model, optimizer, data,
  seed, ...); saved with every checkpoint, compared on `--resume`.
* `claim`: a checkpoint directory or metrics file that holds another run is
  never reused without `--resume`, or `--overwrite`, which says what it
  deletes.
* `restore_latest_intact`: `--resume` takes the newest checkpoint that
  restores, saying which newer ones it skipped and why; nothing is deleted.
* `cut_metrics`: on resume, the metrics file is cut back to the checkpoint's
  step before the run appends to it, so no step is recorded twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

from zpp_jax.checkpoint import Checkpointer
from zpp_jax.data.corpus import expand
from zpp_jax.data.tokenizer import check_spec
from zpp_jax.errors import UsageError

# RunConfig fields that do not change what is trained: where output goes,
# how often it is written, the mesh (a checkpoint restores onto another), and
# the step count (a resumed run may be extended; the learning-rate schedule
# follows the new count).
_NOT_IDENTITY = frozenset(
    {
        "steps",
        "data",  # the corpus counts by its content, wherever it lies
        "val_data",
        "tokenizer",  # by its content too (a path, or bpe:N trained again)
        "vocab_size",  # the tokenizer's
        "nodes",
        "local",
        "eval_every",
        "eval_batches",
        "metrics",
        "plot",
        "ckpt_dir",
        "ckpt_every",
        "resume",
        "overwrite",
        "progress",
    }
)


def identity(cfg: Any, corpus: dict, tokenizer: dict) -> dict[str, Any]:
    """The run's identity: every `RunConfig` field that changes the math
    (the ZeRO++ configuration included, the mesh not), the tokenizer and
    the corpus by their content (`Tokenizer.fingerprint`, the corpus's
    length and SHA-256), not by their paths."""
    out = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_IDENTITY
    }
    # What a unit recomputes changes memory and time, not the math.
    out["zero"] = {
        f.name: getattr(cfg.zero, f.name) for f in dataclasses.fields(cfg.zero) if f.name != "remat"
    }
    out["tokenizer"] = tokenizer
    out["corpus"] = corpus
    return json.loads(json.dumps(out))  # as it reads back from a checkpoint


def differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """``name: saved -> current`` for each field that differs."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "(absent)"), current.get(key, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a} -> {b}")
    return out


# -- paths --------------------------------------------------------------------------


def check_paths(cfg: Any) -> None:
    """Raise UsageError, naming the path and the problem, unless the data is
    a readable file and the metrics, plot and checkpoint locations can be
    written (a directory where a file goes, or the reverse, is an error)."""
    for flag, spec in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if not spec:
            continue
        try:
            files = expand(spec)
        except UsageError as e:
            raise UsageError(f"{flag} {e}") from None
        for path in files:
            if not os.access(path, os.R_OK):
                raise UsageError(f"{flag} {path}: not readable")
    check_spec(cfg.tokenizer)
    for flag, path in (("--metrics", cfg.metrics), ("--plot", cfg.plot)):
        if path:
            _check_writable_file(flag, pathlib.Path(path))
    if cfg.ckpt_dir:
        ckpt = pathlib.Path(cfg.ckpt_dir)
        if ckpt.exists() and not ckpt.is_dir():
            raise UsageError(f"--ckpt-dir {ckpt} is a file, not a directory")
        _check_creatable(f"--ckpt-dir {ckpt}", ckpt)


def _check_writable_file(flag: str, path: pathlib.Path) -> None:
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
        return
    _check_creatable(f"{flag} {path}", path.parent)


def _check_creatable(what: str, directory: pathlib.Path) -> None:
    """`directory` exists and is writable, or can be created."""
    p = directory.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise UsageError(f"{what}: {p} is a file, not a directory")
    if not os.access(p, os.W_OK):
        raise UsageError(f"{what}: {p} is not writable")


# -- claiming outputs ---------------------------------------------------------------


def claim(cfg: Any, log: Callable[[str], None], delete: bool = True) -> None:
    """Make sure a new run (no `--resume`) overwrites nothing unasked.

    Raises UsageError when `cfg.ckpt_dir` holds checkpoints or `cfg.metrics`
    holds records, unless `cfg.overwrite`, which deletes those checkpoints
    and that file (where `delete`: one process of a job) and says so
    through `log`."""
    if cfg.resume:
        return
    steps = Checkpointer.steps_in(cfg.ckpt_dir) if cfg.ckpt_dir else []
    metrics = pathlib.Path(cfg.metrics) if cfg.metrics else None
    records = _count_lines(metrics) if metrics and metrics.exists() else 0
    held = []
    if steps:
        held.append(f"--ckpt-dir {cfg.ckpt_dir} holds checkpoints {steps}")
    if records:
        held.append(f"--metrics {metrics} holds {records} records")
    if not held:
        return
    if not cfg.overwrite:
        raise UsageError(
            f"{' and '.join(held)} of another run: pass --resume to continue that run, "
            "--overwrite to delete them, or choose other paths"
        )
    if not delete:
        return
    for step in steps:
        shutil.rmtree(pathlib.Path(cfg.ckpt_dir) / str(step))
    if records:
        metrics.unlink()
    log(f"--overwrite: deleted {' and '.join(held).replace(' holds ', ' ')}")


def _count_lines(path: pathlib.Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


# -- resuming -----------------------------------------------------------------------


def restore_latest_intact(
    checkpointer: Checkpointer, target: Any, want: dict[str, Any], log: Callable[[str], None]
) -> tuple[Any, dict] | None:
    """The newest checkpoint of `checkpointer` that restores into `target`,
    as ``(state, meta)``; None when the directory holds no checkpoint.

    A checkpoint that fails to restore (a truncated or missing file) is
    skipped with a line through `log` naming it and the error; older ones
    are tried in turn. Once one restores, the damaged ones are renamed to
    ``<step>.damaged`` (`Checkpointer.set_aside`): kept on disk, and out of
    the way of the resumed run, which saves those steps again. Nothing is
    deleted.

    Raises:
      UsageError: the newest intact checkpoint is of another run (its
        identity differs from `want`; the message lists the differences),
        or no checkpoint restores.
    """
    steps = sorted(checkpointer.all_steps(), reverse=True)
    if not steps:
        return None
    skipped = []
    for step in steps:
        try:
            meta = checkpointer.read_meta(step)
        except Exception as e:  # noqa: BLE001 - any failure to read means damage
            skipped.append(step)
            log(f"--resume: skipping checkpoint {step}, its metadata is damaged: {_brief(e)}")
            continue
        saved = meta.get("identity")
        if saved is None:
            raise UsageError(
                f"--resume: checkpoint {step} in {checkpointer.directory} records no run "
                "identity (written by another program); start a new run in another --ckpt-dir"
            )
        diff = differences(saved, want)
        if diff:
            raise UsageError(
                f"--resume: checkpoint {step} in {checkpointer.directory} is of another run: "
                + "; ".join(diff)
                + " (saved -> now); resume with the saved settings or use another --ckpt-dir"
            )
        try:
            state, meta = checkpointer.restore(target, step)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read means damage
            skipped.append(step)
            log(f"--resume: skipping checkpoint {step}, it is damaged: {_brief(e)}")
            continue
        if skipped:
            kept = [checkpointer.set_aside(s).name for s in skipped]
            log(
                f"--resume: restored checkpoint {step} (skipped damaged {skipped}; kept on "
                f"disk as {', '.join(kept)})"
            )
        return state, meta
    raise UsageError(
        f"--resume: none of the checkpoints {steps} in {checkpointer.directory} restores "
        "(all damaged; see the lines above)"
    )


def _brief(e: Exception) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line[:200]}"


def cut_metrics(path: str | None, step: int) -> None:
    """Drop the records after `step` from the metrics file at `path` (those
    of steps that a resumed run repeats); a record cut short by a crash is
    dropped too. Rewrites the file atomically."""
    if not path or not pathlib.Path(path).exists():
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", 0) <= step:
                kept.append(json.dumps(record))
    tmp = pathlib.Path(f"{path}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
