"""Text to token ids: bytes as they are, a byte-level BPE trained here with
the `tokenizers` library, or a saved `tokenizer.json`.

`make_tokenizer(spec, train_text)` reads `--tokenizer`:

* ``byte``: each byte is a token (256 ids);
* ``bpe:N``: a byte-level BPE of N ids trained on `train_text` (locally,
  no download; the same text gives the same tokenizer);
* a path to a `tokenizer.json` (`tokenizers`' format).

Every tokenizer also gives the byte length of each id (`token_bytes`), so a
loss per token converts to bits per byte, comparable across tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Sequence

import numpy as np

from zpp_jax.errors import UsageError

BYTE_VOCAB = 256
# The largest vocabularies of published models (Gemma's) are 2^18 ids.
MAX_BPE_VOCAB = 1 << 18
# Encoding and training read the text in pieces cut after a newline near
# this size, the same pieces every time.
_PIECE = 1 << 20


class Tokenizer:
    """`encode(data: bytes) -> ids` (uint16 below 65,536 ids, else uint32),
    `vocab_size`, `token_bytes` (bytes each id stands for), `to_json()`
    (None for bytes) and `fingerprint()` (what a checkpoint records: the
    vocabulary size and a SHA-256 of the JSON, not where it came from)."""

    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray:
        raise NotImplementedError

    def encode_text(self, text: str, special: bool = False) -> np.ndarray:
        """The ids of one piece of text, as int32; with `special`, the
        tokens a tokenizer adds around a sequence (a BOS), if it has any."""
        return self.encode(text.encode()).astype(np.int32)

    def decode(self, ids) -> str:
        """The text of `ids` (bytes that are not UTF-8 shown as U+FFFD)."""
        raise NotImplementedError

    @property
    def token_bytes(self) -> np.ndarray:
        raise NotImplementedError

    def to_json(self) -> str | None:
        return None

    def token_id(self, token: str) -> int | None:
        """The id of `token` (such as a special token's text), if it is one."""
        return None

    def fingerprint(self) -> dict:
        text = self.to_json()
        digest = hashlib.sha256(text.encode()).hexdigest() if text else None
        return {"vocab_size": self.vocab_size, "sha256": digest}

    @property
    def dtype(self):
        return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32


class ByteTokenizer(Tokenizer):
    vocab_size = BYTE_VOCAB

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB).decode(errors="replace")

    @property
    def token_bytes(self) -> np.ndarray:
        return np.ones(BYTE_VOCAB, np.int64)


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer`: one trained here or loaded from a file."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, data: bytes) -> np.ndarray:
        pieces = [p.decode("utf-8", errors="replace") for p in _pieces(data)]
        ids = [np.asarray(e.ids, self.dtype) for e in self.tok.encode_batch(pieces)]
        return np.concatenate(ids) if ids else np.zeros(0, self.dtype)

    def encode_text(self, text: str, special: bool = False) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=special).ids, np.int32)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def token_bytes(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, np.int64)
        special = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        byte_level = json.loads(self.to_json()).get("decoder", {}) or {}
        byte_level = byte_level.get("type") == "ByteLevel"
        for token, i in self.tok.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            # Byte-level vocabularies spell each byte as one character.
            out[i] = len(token) if byte_level else len(self.tok.decode([i]).encode())
        return out

    def to_json(self) -> str:
        return self.tok.to_str()

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(self.to_json())


def train_bpe(text: bytes, vocab_size: int, special_tokens: Sequence[str] = ()) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` ids (the 256 bytes and merges)
    trained on `text`: deterministic, local. `special_tokens` (such as an
    end of sequence, ``"<eos>"``) are ids 0, 1, ... (among the
    `vocab_size`): never split, never a merge."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not text:
        raise UsageError("cannot train a BPE on an empty corpus")
    if vocab_size - BYTE_VOCAB >= len(text):
        # Each merge joins a pair of the text's tokens: at most len - 1 of them.
        raise UsageError(
            f"--tokenizer bpe:{vocab_size}: a training text of {len(text):,} bytes makes at most "
            f"{len(text) - 1:,} merges; use bpe:N with N at most {BYTE_VOCAB + len(text) - 1:,}, "
            "or more text"
        )
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(special_tokens),
        show_progress=False,
    )
    tok.train_from_iterator((p.decode("utf-8", errors="replace") for p in _pieces(text)), trainer)
    return HFTokenizer(tok)


def load_tokenizer(path: str | pathlib.Path) -> HFTokenizer:
    from tokenizers import Tokenizer as _Tok

    path = pathlib.Path(path)
    if not path.is_file():
        raise UsageError(f"--tokenizer {path}: no such file (bpe:N trains one, byte uses bytes)")
    try:
        return HFTokenizer(_Tok.from_file(str(path)))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
        raise UsageError(f"{path}: not a tokenizers tokenizer.json ({e})") from None


def bpe_size(spec: str) -> int | None:
    """N of a ``bpe:N`` spec, None for another spec."""
    if not spec.startswith("bpe:"):
        return None
    try:
        n = int(spec[4:])
    except ValueError:
        n = 0
    if not BYTE_VOCAB < n <= MAX_BPE_VOCAB:
        raise UsageError(
            f"--tokenizer {spec}: N must be an integer from {BYTE_VOCAB + 1} to "
            f"{MAX_BPE_VOCAB:,} (the bytes, plus merges), e.g. bpe:4096"
        )
    return n


def check_spec(spec: str) -> None:
    """Raise UsageError unless `spec` is byte, bpe:N or an existing file."""
    if spec != "byte" and bpe_size(spec) is None and not pathlib.Path(spec).is_file():
        raise UsageError(
            f"--tokenizer {spec}: no such file; use byte, bpe:N or the path of a tokenizer.json"
        )


def make_tokenizer(
    spec: str, train_text: bytes | None = None, saved: str | pathlib.Path | None = None
) -> Tokenizer:
    """The tokenizer `spec` names. For ``bpe:N``, the one saved at `saved` if
    there is one (a resumed run reuses its own), else one trained on
    `train_text`."""
    if spec == "byte":
        return ByteTokenizer()
    n = bpe_size(spec)
    if n is None:
        return load_tokenizer(spec)
    if saved is not None and pathlib.Path(saved).is_file():
        out = load_tokenizer(saved)
        if out.vocab_size != n:
            raise UsageError(
                f"--resume: --tokenizer {spec} does not match {saved}, the BPE of "
                f"{out.vocab_size} ids the checkpoints were trained with; resume with "
                f"--tokenizer bpe:{out.vocab_size} or start a new run in another --ckpt-dir"
            )
        return out
    if train_text is None:
        raise UsageError(f"--tokenizer {spec} trains on text: pass text with --data")
    return train_bpe(train_text, n)


def _pieces(data: bytes):
    """`data` cut after the first newline past every `_PIECE` bytes."""
    start = 0
    while start < len(data):
        cut = data.find(b"\n", start + _PIECE)
        end = len(data) if cut < 0 else cut + 1
        yield data[start:end]
        start = end
