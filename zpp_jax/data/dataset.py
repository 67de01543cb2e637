"""Training and validation windows of a token corpus, as a pure function of
(seed, split, batch index), so that a run resumes exactly."""

from __future__ import annotations

import numpy as np

from zpp_jax.errors import UsageError, count


class TokenDataset:
    """Random windows of `seq_len + 1` tokens from a train or validation split.

    `tokens`: a 1-D array of ids, or anything sliceable like one (a
    memory-mapped `TokenFiles`: only the windows read are loaded). The last
    `val_fraction` is held out, unless `val_tokens` gives the validation
    split. With `vocab_size`, every id is checked to be below it (one pass
    over the corpus, a piece at a time).

    Batch `index` of a split is a pure function of (seed, split, index):
    resuming at a data position reproduces the exact batches an
    uninterrupted run would have seen, and ``rows=`` reads only some rows of
    a batch, the same as the full batch has there.
    """

    def __init__(
        self,
        tokens,
        seq_len: int,
        val_fraction: float = 0.05,
        vocab_size: int | None = None,
        val_tokens=None,
    ):
        if val_tokens is None and not 0 < val_fraction < 1:
            raise UsageError(f"val_fraction must be in (0, 1), got {val_fraction}")
        count(1, 2**31 - 2, "tokens per sequence").check("seq_len", seq_len)
        self.seq_len = seq_len
        if val_tokens is None:
            split = int(len(tokens) * (1 - val_fraction))
            self.splits = {"train": _View(tokens, 0, split), "val": _View(tokens, split, None)}
        else:
            self.splits = {"train": _View(tokens, 0, None), "val": _View(val_tokens, 0, None)}
        if vocab_size is not None:
            for view in self.splits.values():
                view.check_vocab(vocab_size)
        for name, view in self.splits.items():
            if len(view) <= seq_len + 1:
                raise UsageError(
                    f"the {name} split has {len(view)} tokens, too few for seq_len={seq_len}; "
                    "use more text or a shorter sequence"
                )

    def starts(self, split: str, index: int, batch_size: int, seed: int) -> np.ndarray:
        """Where each row of batch `index` starts in its split."""
        n = len(self._split(split))
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        return rng.integers(0, n - self.seq_len - 1, size=batch_size)

    def batch(
        self, split: str, index: int, batch_size: int, seed: int, rows=None
    ) -> dict[str, np.ndarray]:
        """{"inputs", "targets"}: int32 (batch_size, seq_len), targets shifted
        by one. With `rows` (indices into the batch), only those rows are
        read; the others are zero."""
        view = self._split(split)
        count(why="sequences").check("batch_size", batch_size)
        starts = self.starts(split, index, batch_size, seed)
        rows = range(batch_size) if rows is None else rows
        windows = np.zeros((batch_size, self.seq_len + 1), np.int32)
        for r in rows:
            windows[r] = view[int(starts[r]) : int(starts[r]) + self.seq_len + 1]
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def bytes_per_token(self, split: str, token_bytes: np.ndarray) -> float:
        """Mean of `token_bytes` (bytes per id, `Tokenizer.token_bytes`) over
        the split's tokens: one pass, a piece at a time."""
        view = self._split(split)
        return sum(int(token_bytes[piece].sum()) for _, piece in view.pieces()) / len(view)

    def _split(self, split: str) -> _View:
        if split not in self.splits:
            raise UsageError(f"no split {split!r}: a TokenDataset has {sorted(self.splits)}")
        return self.splits[split]


class _View:
    """tokens[start:stop] without copying: slices read through."""

    def __init__(self, tokens, start: int, stop: int | None) -> None:
        self.tokens, self.start = tokens, start
        self.stop = len(tokens) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, _ = key.indices(len(self))
        return np.asarray(self.tokens[self.start + a : self.start + b])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole split, read into memory."""
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def pieces(self, size: int = 1 << 22):
        """(offset, tokens) in pieces of at most `size` tokens: a pass over
        the split that holds one piece at a time."""
        for a in range(0, len(self), size):
            yield a, self[a : a + size]

    def check_vocab(self, vocab_size: int) -> None:
        for a, chunk in self.pieces():
            if chunk.size and int(chunk.max()) >= vocab_size:
                first = int(np.argmax(chunk >= vocab_size))
                at = self.start + a + first
                where = f"position {at}"
                if hasattr(self.tokens, "where"):
                    path, pos = self.tokens.where(at)
                    where = f"{path}, position {pos}"
                raise UsageError(
                    f"token id {int(chunk[first])} at {where} is outside the vocabulary of "
                    f"{vocab_size}; use the tokenizer that made these tokens (--tokenizer PATH) "
                    "or a model with a larger vocabulary"
                )
