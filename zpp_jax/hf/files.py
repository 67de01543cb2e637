"""Safetensors weight files of a checkpoint directory: which file holds each
tensor, slices read lazily, and tensors written one at a time.

Reading goes through `safetensors.safe_open`, which maps the file and copies
out only the slice asked for. Writing streams: the header is computed from
the shapes first, then each tensor's bytes are appended as they come, so a
writer holds one tensor at a time, never a whole shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import struct
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open

from zpp_jax.errors import UsageError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each tensor's file: from the index, or the one weights file.

    Raises:
      UsageError: neither file exists, or the index names a missing shard.
    """
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise UsageError(
                f"{index} is not a JSON index of the weights: download it again"
            ) from None
        files = {name: directory / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise UsageError(f"{index} names the shard {file.name}, which does not exist")
        return files
    single = directory / WEIGHTS
    if not single.is_file():
        raise UsageError(f"{directory} has neither {WEIGHTS} nor {INDEX}")
    with open_weights(single) as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - not a dict


def open_weights(file: pathlib.Path):
    """`safe_open(file)`; a file that is not safetensors (cut off in a
    download, or a git-lfs pointer checked out without git-lfs) raises
    UsageError naming it and the fix."""
    try:
        return safe_open(file, "numpy")
    except Exception as e:  # safetensors' own error, or the OS's
        raise UsageError(damaged(file, e)) from None


def damaged(file: pathlib.Path, error: Exception) -> str:
    """What is wrong with a weights file that cannot be read, and the fix."""
    try:
        with open(file, "rb") as f:
            start = f.read(64)
    except OSError:
        start = b""
    if start.startswith(b"version https://git-lfs"):
        return (
            f"{file} is a git-lfs pointer, not the weights: fetch them (git lfs install && "
            "git lfs pull in the checkpoint's repository)"
        )
    return (
        f"{file} cannot be read as safetensors ({error}): it is cut off or damaged; "
        "download it again"
    )


class TensorReader:
    """Slices of the tensors of a checkpoint's files (a context manager;
    the files close on exit, or on `release`).

    An open file is mapped into memory, and the pages a read touches count
    as the process's resident memory until the file closes: a reader that
    calls `release` after each tensor keeps at most one tensor's pages."""

    def __init__(self, files: dict[str, pathlib.Path]):
        self._files = files
        self._stack = contextlib.ExitStack()
        self._open: dict[pathlib.Path, object] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Close the open files (reopened on the next read)."""
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self._open.clear()

    def _handle(self, name: str):
        file = self._files[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(open_weights(file))
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape `name` is stored with (reads the header only)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype `name` is stored in ("F32", "BF16", "I8",
        ...; reads the header only)."""
        return str(self._handle(name).get_slice(name).get_dtype())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """`name`'s elements at `index` (a tuple of slices; None: all). Only
        the slice is copied out of the file."""
        part = self._handle(name).get_slice(name)
        try:
            return part[:] if index is None else part[index]
        except Exception as e:  # the header promised bytes the file does not hold
            raise UsageError(damaged(self._files[name], e)) from None


def fingerprint(directory: pathlib.Path, samples: int = 16, sample_bytes: int = 1 << 16) -> dict:
    """What identifies a checkpoint by its content, cheaply: a SHA-256 of
    its config.json and of each weight file's size, header, and `samples`
    runs of `sample_bytes` spread through its data. Reads about 1 MiB per
    file, whatever its size; two checkpoints that differ anywhere but
    between the samples get different fingerprints."""
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for file in sorted(set(weight_files(directory).values())):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for offset in np.linspace(0, max(size - sample_bytes, 0), samples).astype(int):
                f.seek(int(offset))
                digest.update(f.read(sample_bytes))
            f.seek(0)
            (header,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header, 1 << 26)))
    return {"sha256": digest.hexdigest()}


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, grouped into files of at most
    `max_shard_bytes` (a larger tensor alone in its file)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_streamed(
    file: pathlib.Path,
    specs: dict[str, tuple[tuple[int, ...], str]],
    values: Callable[[str], np.ndarray],
) -> None:
    """Write a safetensors file of the tensors `specs` names ((shape, dtype
    name) each), asking `values(name)` for each one's array in turn; only
    one is held at a time."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in specs.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        header[name] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for name, (shape, dtype) in specs.items():
            value = np.ascontiguousarray(values(name), DTYPES[dtype])
            if value.shape != tuple(shape):
                raise ValueError(f"{name}: got shape {value.shape}, declared {tuple(shape)}")
            out.write(value.tobytes())


def remove_weights(directory: pathlib.Path) -> None:
    """Delete a checkpoint's weights in `directory`: ``model.safetensors``,
    its shards (``model-*-of-*.safetensors``) and their index. Other files
    stay. A save over an export of more shards would otherwise leave the
    old index and shards, which a load then reads."""
    shards = directory.glob("model-*-of-*.safetensors")
    for file in [directory / WEIGHTS, directory / INDEX, *shards]:
        if file.is_file():
            file.unlink()


def shard_file_names(count: int) -> Iterator[str]:
    """The file names Hugging Face gives `count` weight files."""
    if count == 1:
        yield WEIGHTS
        return
    for i in range(1, count + 1):
        yield f"model-{i:05d}-of-{count:05d}.safetensors"
