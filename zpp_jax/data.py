"""Byte-level text data: a corpus, a train/validation split, and batches that
depend only on (seed, split, batch index), so a run resumes exactly."""

from __future__ import annotations

import pathlib
import sysconfig

import jax
import numpy as np

from zpp_jax.errors import UsageError

VOCAB_SIZE = 256


def stdlib_corpus(max_bytes: int = 16 << 20) -> np.ndarray:
    """Bytes of the Python standard library's own source files (sorted by path,
    at most `max_bytes`): a real corpus that needs no download."""
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
    return np.concatenate(chunks)[:max_bytes]


def load_text(path: str | pathlib.Path) -> np.ndarray:
    """The bytes of any file, as tokens."""
    data = pathlib.Path(path).read_bytes()
    if not data:
        raise UsageError(f"{path} is empty")
    return np.frombuffer(data, np.uint8)


class ByteDataset:
    """Random windows of `seq_len + 1` bytes from a train or validation split.
    With `vocab_size`, every token id is checked to be below it.

    The last `val_fraction` of the corpus is held out. Batch `index` of a split
    is a pure function of (seed, split, index): resuming at a data position
    reproduces the exact batches an uninterrupted run would have seen.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        val_fraction: float = 0.05,
        vocab_size: int | None = None,
    ):
        if not 0 < val_fraction < 1:
            raise UsageError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
            first = int(np.argmax(tokens >= vocab_size))
            raise UsageError(
                f"token id {int(tokens[first])} at position {first} is outside the model's "
                f"vocabulary of {vocab_size}; use a model with a larger vocab_size"
            )
        split = int(len(tokens) * (1 - val_fraction))
        self.seq_len = seq_len
        self.splits = {"train": tokens[:split], "val": tokens[split:]}
        for name, toks in self.splits.items():
            if len(toks) <= seq_len + 1:
                raise UsageError(
                    f"the {name} split has {len(toks)} tokens, too few for seq_len={seq_len}; "
                    "use more text or a shorter sequence"
                )

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        """{"inputs", "targets"}: int32 (batch_size, seq_len), targets shifted by one."""
        toks = self.splits[split]
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        starts = rng.integers(0, len(toks) - self.seq_len - 1, size=batch_size)
        windows = np.stack([toks[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def host_to_global(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Global arrays from host arrays that every process holds in full: each
    process copies only the rows of its own devices (works in one process and
    under `jax.distributed` alike)."""
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in batch.items()
    }
