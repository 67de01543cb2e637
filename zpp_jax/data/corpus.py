"""Where the tokens come from: text (a file, a directory or a glob of files)
or pre-tokenized token files (nanoGPT's uint16 `.bin`, `.npy` of uint16 or
uint32), the latter memory-mapped and never read whole into memory."""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import os
import pathlib
import sysconfig

import numpy as np

from zpp_jax.errors import UsageError

TOKEN_SUFFIXES = (".bin", ".npy")


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 16 << 20) -> np.ndarray:
    """Bytes of the Python standard library's own source files (sorted by path,
    at most `max_bytes`): a real corpus that needs no download. Read once
    per process and size; the array is read-only."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(np.frombuffer(data, np.uint8))
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise UsageError(f"no Python source files found under {root}; pass --data FILE")
    out = np.concatenate(chunks)[:max_bytes]
    out.setflags(write=False)
    return out


def load_text(path: str | pathlib.Path) -> np.ndarray:
    """The bytes of any file, as tokens."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    data = path.read_bytes()
    if not data:
        raise UsageError(f"{path} is empty")
    return np.frombuffer(data, np.uint8)


def expand(spec: str) -> list[pathlib.Path]:
    """The files `spec` names, sorted: a file, every file under a directory
    (recursively, hidden ones skipped), or a glob pattern."""
    path = pathlib.Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise UsageError(f"{spec}: the directory holds no files")
        return files
    if glob.has_magic(spec):
        files = sorted(pathlib.Path(p) for p in glob.glob(spec, recursive=True))
        files = [p for p in files if p.is_file()]
        if not files:
            raise UsageError(f"{spec}: the pattern matches no file")
        return files
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:  # Python 3.11 names a loop so
            raise UsageError(f"{spec}: a loop of symbolic links, it reaches no file") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UsageError(f"{spec}: a loop of symbolic links, it reaches no file") from None
        raise UsageError(f"{spec}: a symbolic link to {os.readlink(path)}, which does not exist")
    raise UsageError(f"{spec}: no such file or directory")


def is_token_files(files: list[pathlib.Path]) -> bool:
    """True for pre-tokenized files; a mix with text files is refused."""
    tokens = [p.suffix in TOKEN_SUFFIXES for p in files]
    if any(tokens) and not all(tokens):
        raise UsageError(
            f"{files[tokens.index(True)]} is a token file and {files[tokens.index(False)]} is "
            "not: pass text files or token files (.bin, .npy), not both"
        )
    return bool(files) and all(tokens)


def read_text(files: list[pathlib.Path], not_text: list[str] | None = None) -> bytes:
    """The files' bytes, concatenated in order. With a `not_text` list, a
    line naming each file that does not look like text (`text_problem`) is
    appended to it."""
    parts = []
    for path in files:
        data = path.read_bytes()
        problem = text_problem(path, data) if not_text is not None else None
        if problem:
            not_text.append(problem)
        parts.append(data)
    data = b"".join(parts)
    if not data:
        raise UsageError(f"{_names(files)}: the corpus is empty")
    return data


def text_problem(path: pathlib.Path, data: bytes) -> str | None:
    """Why `data` (the bytes of `path`) does not look like text: more than
    1% NUL bytes (a binary file), or bytes that are not UTF-8 (with the
    offset of the first); None for UTF-8 text."""
    nuls = data.count(0)
    if nuls > len(data) / 100:
        return f"{path}: {nuls / len(data):.0%} of its {len(data):,} bytes are NUL (a binary file?)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{path}: not UTF-8 text, from byte {e.start:,} ({data[e.start : e.start + 4]!r})"
    return None


class TokenFiles:
    """Token files as one read-only 1-D array of ids: `len()`, slicing
    (``files[a:b]``, a copy of only those tokens) and `dtype`. Each file is
    memory-mapped; nothing is read until sliced."""

    def __init__(self, files: list[pathlib.Path]) -> None:
        self.files = files
        self.parts = [_map(p) for p in files]
        sizes = [len(p) for p in self.parts]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if self.offsets[-1] == 0:
            raise UsageError(f"{_names(files)}: the corpus is empty")
        self.dtype = np.result_type(*(p.dtype for p in self.parts))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenFiles supports contiguous slices only")
        start, stop, _ = key.indices(len(self))
        out = []
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        for i in range(max(first, 0), len(self.parts)):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            if lo >= stop:
                break
            a, b = max(start, lo) - lo, min(stop, hi) - lo
            if b > a:
                out.append(np.asarray(self.parts[i][a:b], self.dtype))
        return np.concatenate(out) if out else np.zeros(0, self.dtype)

    def where(self, position: int) -> tuple[pathlib.Path, int]:
        """The file and the position in it of a global token position."""
        i = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return self.files[i], position - int(self.offsets[i])

    def fingerprint(self) -> dict:
        """The files' sizes and a SHA-256 of 64 evenly spaced 64 KiB pieces
        of each (a corpus of any size is identified without reading it all)."""
        h = hashlib.sha256()
        for p in self.files:
            size = p.stat().st_size
            h.update(str(size).encode())
            with p.open("rb") as f:
                for k in range(64):
                    f.seek(size * k // 64)
                    h.update(f.read(1 << 16))
        return {"tokens": len(self), "files": len(self.files), "sha256": h.hexdigest()}


def _map(path: pathlib.Path) -> np.ndarray:
    if path.suffix == ".bin":  # nanoGPT: raw uint16, no header
        size = path.stat().st_size
        if size % 2:
            raise UsageError(
                f"{path}: {size} bytes is not a whole number of uint16 tokens (2 bytes each); "
                "a .bin token file holds raw uint16 ids"
            )
        if size == 0:
            return np.zeros(0, np.uint16)
        return np.memmap(path, np.uint16, mode="r")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise UsageError(f"{path}: not a .npy array ({e})") from None
    if arr.ndim != 1 or arr.dtype not in (np.uint16, np.uint32):
        raise UsageError(
            f"{path}: a token file is a 1-D array of uint16 or uint32, this one is "
            f"{arr.dtype} of shape {arr.shape}"
        )
    return arr


def _names(files: list[pathlib.Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"
