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
* `OutputLock`: one run at a time writes a checkpoint directory or a
  metrics file; a second is refused, naming the first.
* `MetricsSink`: the records, one whole line each, to a file or a stream
  (`-`, a pipe, a device), which is never read back, cut or replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax

from zpp_jax.checkpoint import Checkpointer, check_directory
from zpp_jax.data.corpus import expand
from zpp_jax.data.tokenizer import check_spec
from zpp_jax.distributed import max_over_processes
from zpp_jax.errors import (
    OutputError,
    UsageError,
    check_creatable,
    check_stream,
    check_writable_file,
    is_stream,
    read_json_object,
)

# RunConfig fields that do not change what is trained: where output goes,
# how often it is written, the mesh (a checkpoint restores onto another), and
# the step count (a resumed run may be extended; the learning-rate schedule
# follows the new count).
CONFIG_FILE = "config.json"  # in --ckpt-dir: the model's Hugging Face config
BASE_FILE = "init.json"  # in --ckpt-dir: where the --init checkpoint was
# The files beside an --init checkpoint's weights that the model does not
# read but its users do (the chat template, special tokens, generation
# defaults): kept in --ckpt-dir as they are, and exported with the weights.
COMPANION_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)

_NOT_IDENTITY = frozenset(
    {
        "steps",
        "data",  # the corpus counts by its content, wherever it lies
        "init",  # so does the initial checkpoint
        "val_data",
        "tokenizer",  # by its content too (a path, or bpe:N trained again)
        "accept_binary",
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


def save_model_config(cfg: Any, model_cfg: Any) -> None:
    """Keep the model's config.json in the run's checkpoint directory (for
    `export_hf`): the initial checkpoint's, with the `COMPANION_FILES` it
    has, or, for a Llama preset, the one `zpp_jax.hf.save` would write. A
    GPT has none."""
    if not cfg.ckpt_dir or (cfg.init is None and cfg.arch != "llama"):
        return
    target = pathlib.Path(cfg.ckpt_dir) / CONFIG_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    if cfg.init is not None:
        shutil.copyfile(pathlib.Path(cfg.init) / CONFIG_FILE, target)
        base = {"init": str(pathlib.Path(cfg.init).resolve())}
        (target.parent / BASE_FILE).write_text(json.dumps(base) + "\n")
        for name in COMPANION_FILES:
            if (pathlib.Path(cfg.init) / name).is_file():
                shutil.copyfile(pathlib.Path(cfg.init) / name, target.parent / name)
    else:
        from zpp_jax.hf.checkpoint import checkpoint_config

        target.write_text(json.dumps(checkpoint_config(model_cfg, "float32"), indent=2) + "\n")


def identity(cfg: Any, corpus: dict, tokenizer: dict, init: dict | None = None) -> dict[str, Any]:
    """The run's identity: every `RunConfig` field that changes the math
    (the ZeRO++ configuration included, the mesh not), the tokenizer, the
    corpus and the initial checkpoint (`init`: `zpp_jax.hf.fingerprint`)
    by their content (`Tokenizer.fingerprint`, the corpus's length and
    SHA-256), not by their paths."""
    out = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_IDENTITY
    }
    # What a unit recomputes changes memory and time, not the math.
    out["zero"] = {
        f.name: getattr(cfg.zero, f.name) for f in dataclasses.fields(cfg.zero) if f.name != "remat"
    }
    out["tokenizer"] = tokenizer
    out["corpus"] = corpus
    if init is not None:
        out["init"] = init
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


def check_init(init: str) -> None:
    """Raise UsageError unless `init` is a checkpoint directory of a
    supported family with a tokenizer.json, whose config.json, weight
    files and tensors' names and shapes `zpp_jax.hf.load` accepts (headers
    only: nothing is read or written)."""
    from zpp_jax.hf.checkpoint import check

    try:
        check(init)
    except UsageError as e:
        raise UsageError(f"--init: {e}") from None
    if not (pathlib.Path(init) / "tokenizer.json").is_file():
        raise UsageError(
            f"--init {init} has no tokenizer.json: copy the checkpoint's tokenizer.json there "
            "(a run from a checkpoint uses its tokenizer)"
        )
    # The run keeps them and its export carries them: a damaged one is
    # refused now, not when `zpp sample` or transformers reads it.
    for name in COMPANION_FILES:
        if name.endswith(".json") and (pathlib.Path(init) / name).is_file():
            read_json_object(pathlib.Path(init) / name)


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
    if cfg.init is not None:
        check_init(cfg.init)
    else:
        check_spec(cfg.tokenizer)
    if cfg.metrics and is_stream(cfg.metrics):
        check_stream("--metrics", cfg.metrics)
    elif cfg.metrics:
        check_writable_file("--metrics", pathlib.Path(cfg.metrics))
    if cfg.plot:
        if is_stream(cfg.plot):
            raise UsageError(f"--plot {cfg.plot}: a plot is a PNG file; give a file name")
        check_writable_file("--plot", pathlib.Path(cfg.plot))
    if cfg.ckpt_dir:
        ckpt = pathlib.Path(cfg.ckpt_dir)
        check_directory(ckpt, "--ckpt-dir")
        check_creatable(f"--ckpt-dir {ckpt}", ckpt)
    _check_distinct(cfg)


def _check_distinct(cfg: Any) -> None:
    """The metrics, the plot and the checkpoint directory are three paths,
    and the plot is a PNG."""
    paths = {
        "--metrics": cfg.metrics and cfg.metrics != "-" and pathlib.Path(cfg.metrics).absolute(),
        "--plot": cfg.plot and pathlib.Path(cfg.plot).absolute(),
        "--ckpt-dir": cfg.ckpt_dir and pathlib.Path(cfg.ckpt_dir).absolute(),
    }
    named = [(flag, p) for flag, p in paths.items() if p]
    for i, (flag, path) in enumerate(named):
        for other, other_path in named[i + 1 :]:
            if path == other_path:
                raise UsageError(f"{flag} and {other} are the same path, {path}: give each its own")
    if cfg.plot and pathlib.Path(cfg.plot).suffix.lower() != ".png":
        raise UsageError(f"--plot {cfg.plot}: the plot is a PNG image; give a name ending in .png")


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
    metrics = metrics_file(cfg.metrics)
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


def metrics_file(path: str | None) -> pathlib.Path | None:
    """The regular file a `--metrics` path names, its symbolic links
    followed (so that the link is kept, and its target written); None for
    no path or a stream."""
    if not path or is_stream(path):
        return None
    return pathlib.Path(os.path.realpath(path))


def _count_lines(path: pathlib.Path) -> int:
    """Non-empty lines of a regular file (read in chunks: bounded memory)."""
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
    """The first line of the innermost error under `e` (what the file or
    the operating system said, not the layers that passed it on)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line[:200]}"


def cut_metrics(path: str | None, step: int) -> None:
    """Drop the records after `step` from the metrics file at `path` (those
    of steps that a resumed run repeats); a record cut short by a crash is
    dropped too. Rewrites the file atomically, line by line (bounded
    memory); a symbolic link is kept and its target rewritten. A stream is
    left alone: it is never read back."""
    file = metrics_file(path)
    if file is None or not file.exists() or _records_up_to(file, step):
        return
    tmp = file.with_name(f"{file.name}.tmp")
    try:
        with open(file) as src, open(tmp, "w") as dst:
            for line in src:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("step", 0) <= step:
                    dst.write(json.dumps(record) + "\n")
        os.replace(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"--metrics {path}: could not cut it back to step {step}: {e}") from None


def _records_up_to(file: pathlib.Path, step: int) -> bool:
    """Whether every line of `file` is a whole record of a step <= `step`
    (then there is nothing to cut)."""
    with open(file) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) > step:
                    return False
            except json.JSONDecodeError:
                return False
    return True


# -- one writer per run -------------------------------------------------------------


class OutputLock:
    """Exclusive use of a run's checkpoint directory and metrics file, for
    as long as the lock is held (`release`, or the end of the process).

    An advisory lock (``flock``) on a small file: ``.zpp-lock`` inside the
    checkpoint directory, ``.<name>.zpp-lock`` beside the metrics file,
    which holds who took it. The kernel drops the lock when its process
    ends, however it ends, so a crashed run never leaves a stale lock. A
    stream (`is_stream`) is not locked. Costs two open files."""

    def __init__(self, cfg: Any) -> None:
        """Take the locks of `cfg.ckpt_dir` and `cfg.metrics`.

        Raises:
          OutputError: another process holds one; the message names it.
        """
        self._fds: list[int] = []
        targets = []
        if cfg.ckpt_dir:
            ckpt = pathlib.Path(cfg.ckpt_dir).absolute()
            targets.append((f"--ckpt-dir {cfg.ckpt_dir}", ckpt / ".zpp-lock"))
        metrics = metrics_file(cfg.metrics)
        if metrics is not None:
            targets.append(
                (f"--metrics {cfg.metrics}", metrics.with_name(f".{metrics.name}.zpp-lock"))
            )
        try:
            for what, lock_file in targets:
                self._fds.append(_take_lock(what, lock_file))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the file drops its lock
        self._fds.clear()

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold_outputs(cfg: Any) -> Iterator[None]:
    """Hold `cfg`'s outputs (`OutputLock`) for the `with` block. In a
    multi-process job process 0 takes the lock and every process learns
    whether it could: all go on, or all raise.

    Raises:
      OutputError: the outputs are in use by another run (process 0's
        message names it; the other processes' say to read it).
    """
    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = OutputLock(cfg)
        except OutputError as e:
            error = e
    try:
        if max_over_processes(error is not None):
            raise error or OutputError(
                "process 0 could not take this run's outputs (its error says why)"
            )
        yield
    finally:
        if lock is not None:
            lock.release()


def _take_lock(what: str, lock_file: pathlib.Path) -> int:
    """The open, locked `lock_file` (made with its directory if need be),
    with this process written into it as the holder."""
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputError(f"{what}: cannot create its lock file {lock_file}: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 1000).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise OutputError(
            f"{what} is in use by {holder}; wait for that run to end (or stop it), or "
            "choose another path"
        ) from None
    command = " ".join(["zpp", *sys.argv[1:]])[:300]
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    os.ftruncate(fd, 0)
    os.pwrite(
        fd,
        f"process {os.getpid()} on {socket.gethostname()} ({command}), since {since}".encode(),
        0,
    )
    return fd


# -- metrics records ----------------------------------------------------------------


class MetricsSink:
    """Where a run's records go, one JSON line each, flushed line by line.

    A regular file is appended to, and a write that fails part-way (a full
    disk) is cut back, so the file never ends in half a line. A stream
    (`is_stream`: standard output for ``-``) is only ever written.

    Raises `OutputError` (from `write`) when a record cannot be written,
    naming the path and the cause."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stream: TextIO | None = None
        self._fd: int | None = None
        try:
            if path == "-":
                self._stream = sys.stdout
            elif is_stream(path):
                self._stream = open(path, "a")  # noqa: SIM115 - held for the run
            else:
                file = metrics_file(path)
                file.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"--metrics {path}: cannot open it: {e.strerror or e}") from None

    def write(self, line: str) -> None:
        try:
            if self._stream is not None:
                self._stream.write(line + "\n")
                self._stream.flush()
            else:
                self._append((line + "\n").encode())
        except OSError as e:
            raise OutputError(
                f"--metrics {self.path}: a record could not be written: {e.strerror or e}; the "
                "records before it are intact"
            ) from None

    def _append(self, data: bytes) -> None:
        """One whole line at the end of the file, or none of it."""
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a short write: the disk filled up mid-line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._stream is not None and self._stream is not sys.stdout:
            with contextlib.suppress(OSError):
                self._stream.close()
        self._stream = None
