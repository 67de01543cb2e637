"""The data of a `zpp train` run: `--data` / `--val-data` read as text or
token files, `--tokenizer` made (trained, loaded, or the checkpoint's own on
resume), the train and validation token splits, and what identifies them."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
from typing import Any

from zpp_jax.data import TokenDataset, TokenFiles, Tokenizer, expand, make_tokenizer, read_text
from zpp_jax.data.chat import load_chat_template
from zpp_jax.data.corpus import is_token_files, stdlib_corpus
from zpp_jax.data.examples import (
    ExampleDataset,
    check_chat,
    encode_records,
    read_records,
    record_text,
)
from zpp_jax.errors import UsageError

VAL_FRACTION = 0.05
TOKENIZER_FILE = "tokenizer.json"  # in --ckpt-dir, next to the checkpoints


@dataclasses.dataclass
class Corpus:
    """Token splits (`val` None: held out from the end of `train`), the
    tokenizer, and the corpus's identity for checkpoints."""

    tokenizer: Tokenizer
    train: Any
    val: Any
    fingerprint: dict
    source: str

    def dataset(self, seq_len: int, vocab_size: int) -> TokenDataset:
        return TokenDataset(
            self.train, seq_len, VAL_FRACTION, vocab_size=vocab_size, val_tokens=self.val
        )


def load(cfg, warn=print) -> Corpus:
    """Read `cfg.data` (default: the Python standard library's source) and
    `cfg.val_data`, and tokenize text with `cfg.tokenizer_spec`. On resume a
    ``bpe:N`` tokenizer is the one saved in `cfg.ckpt_dir`, not a new one.

    Data that does not look like text (`zpp_jax.data.corpus.text_problem`)
    is refused under a text tokenizer (BPE, a tokenizer.json), and trained
    on bytes with a warning through `warn`, unless `cfg.accept_binary`."""
    saved = _saved_tokenizer(cfg) if cfg.resume else None
    train_files = expand(cfg.data) if cfg.data else None
    val_files = expand(cfg.val_data) if cfg.val_data else None
    jsonl = {_is_jsonl(f) for f in (train_files, val_files) if f is not None}
    if len(jsonl) > 1:
        raise UsageError("--data and --val-data must both be fine-tuning examples (.jsonl) or not")
    if jsonl == {True}:
        return _examples(cfg, train_files, val_files, saved)
    kinds = {is_token_files(f) for f in (train_files, val_files) if f is not None}
    if len(kinds) > 1:
        raise UsageError("--data and --val-data must both be text or both token files")
    if kinds == {True}:
        return _token_files(cfg, train_files, val_files, saved)
    not_text: list[str] = []
    text = read_text(train_files, not_text) if train_files else stdlib_corpus().tobytes()
    source = f"{len(train_files)} text files" if train_files else "the Python standard library"
    if val_files:
        train_text, val_text = text, read_text(val_files, not_text)
    else:
        split = int(len(text) * (1 - VAL_FRACTION))
        train_text, val_text = text[:split], text[split:]
    _check_text(cfg, not_text, warn)
    tokenizer = make_tokenizer(cfg.tokenizer_spec, train_text, saved)
    _check_saved(cfg, tokenizer, saved)
    digest = hashlib.sha256(text + (val_text if val_files else b"")).hexdigest()
    train, val = tokenizer.encode(train_text), tokenizer.encode(val_text)
    if not train.size or not val.size:
        raise UsageError(f"--data {cfg.data}: the corpus is empty")
    fingerprint = {"tokens": int(train.size + val.size), "sha256": digest}
    return Corpus(tokenizer, train, val, fingerprint, source)


def _is_jsonl(files: list[pathlib.Path]) -> bool:
    """Fine-tuning examples: every file .jsonl (a mix is refused). A .json
    file is refused: read as text, a dataset saved as one JSON array would
    be trained on as characters."""
    json_file = next((f for f in files if f.suffix == ".json"), None)
    if json_file is not None:
        raise UsageError(
            f"--data {json_file}: a .json file; fine-tuning examples are JSON Lines, one "
            "record per line in a .jsonl file (a JSON array of records: write each on a line "
            "of its own); text to train on as it is: rename it"
        )
    kinds = {f.suffix == ".jsonl" for f in files}
    if len(kinds) > 1:
        raise UsageError("--data mixes .jsonl fine-tuning examples with other files: pass one kind")
    return kinds == {True}


@dataclasses.dataclass
class Examples:
    """Fine-tuning examples (`zpp_jax.data.examples`), the `Corpus`
    interface: the records, encoded for a sequence length by `dataset`."""

    tokenizer: Tokenizer
    train: list
    val: list
    fingerprint: dict
    source: str
    pad_id: int
    eos: int | None = None
    chat: Any = None  # the checkpoint's ChatTemplate, for conversations

    def dataset(self, seq_len: int, vocab_size: int) -> ExampleDataset:
        """The records encoded, each only as far as a row of `seq_len` + 1
        tokens can use (`encode_records`' `max_tokens`)."""
        encoded = [
            encode_records(records, self.tokenizer, self.eos, self.chat, max_tokens=seq_len + 1)
            for records in (self.train, self.val)
        ]
        return ExampleDataset(*encoded, seq_len, vocab_size, self.pad_id)


def _examples(cfg, train_files, val_files, saved) -> Examples:
    """JSONL records, encoded with the run's tokenizer (a ``bpe:N`` one
    trained on their text), ended by the checkpoint's end-of-sequence id
    with --init; the validation split is --val-data's records, or the
    last 5% of --data's (at least one)."""
    records = read_records(train_files)
    if val_files:
        val_records = read_records(val_files)
    else:
        if len(records) < 2:
            raise UsageError(f"--data {cfg.data}: one record; a validation split needs two")
        cut = len(records) - max(1, int(len(records) * VAL_FRACTION))
        records, val_records = records[:cut], records[cut:]
    text = "\n".join(record_text(r) for r in records).encode()
    tokenizer = make_tokenizer(cfg.tokenizer_spec, text, saved)
    _check_saved(cfg, tokenizer, saved)
    eos = _eos_id(cfg)
    chat = None if cfg.init is None else load_chat_template(cfg.init)
    digest = hashlib.sha256()
    for file in [*train_files, *(val_files or [])]:
        digest.update(file.read_bytes())
    check_chat(records + val_records, chat)
    return Examples(
        tokenizer,
        records,
        val_records,
        {"examples": len(records) + len(val_records), "sha256": digest.hexdigest()},
        f"{len(records) + len(val_records)} fine-tuning examples",
        0 if eos is None else eos,
        eos,
        chat,
    )


def _eos_id(cfg) -> int | None:
    if cfg.init is None:
        return None
    from zpp_jax.hf.config import read_config

    return read_config(cfg.init).eos_token_id


def _check_text(cfg, not_text: list[str], warn) -> None:
    if not not_text or cfg.accept_binary:
        return
    more = f" (and {len(not_text) - 1} more files)" if len(not_text) > 1 else ""
    if cfg.tokenizer_spec != "byte":
        raise UsageError(
            f"--data {not_text[0]}{more}: --tokenizer {cfg.tokenizer_spec} reads text; pass "
            "--accept-binary to train on these bytes anyway, or --tokenizer byte"
        )
    warn(
        f"warning: --data {not_text[0]}{more}; training on its bytes (--accept-binary: no warning)"
    )


def _token_files(cfg, train_files, val_files, saved) -> Corpus:
    if cfg.tokenizer_spec.startswith("bpe:"):
        raise UsageError(
            f"--tokenizer {cfg.tokenizer_spec} trains on text, and --data {cfg.data} holds token "
            "files: pass the tokenizer.json that made them (--tokenizer PATH), or byte"
        )
    tokenizer = make_tokenizer(cfg.tokenizer_spec, None, saved)
    _check_saved(cfg, tokenizer, saved)
    train = TokenFiles(train_files)
    val = TokenFiles(val_files) if val_files else None
    fingerprint = {"train": train.fingerprint()}
    if val is not None:
        fingerprint["val"] = val.fingerprint()
    return Corpus(tokenizer, train, val, fingerprint, f"{len(train_files)} token files")


def bytes_per_token(data: TokenDataset | ExampleDataset, tokenizer: Tokenizer) -> float:
    """Mean bytes per token of the validation split (per learned token of
    examples): a loss in nats per token over this times ln 2 is bits per
    byte."""
    return data.bytes_per_token("val", tokenizer.token_bytes)


def bits_per_byte(loss: float, per_token: float) -> float | None:
    """The loss in bits per byte; None where the learned tokens hold no
    bytes (examples whose completions are empty learn only their EOS)."""
    return loss / math.log(2) / per_token if per_token > 0 else None


def save_tokenizer(cfg, tokenizer: Tokenizer) -> None:
    """Keep the run's tokenizer next to its checkpoints (process 0)."""
    text = tokenizer.to_json()
    if cfg.ckpt_dir and text is not None:
        path = pathlib.Path(cfg.ckpt_dir) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _check_saved(cfg, tokenizer: Tokenizer, saved: pathlib.Path | None) -> None:
    """On resume: the tokenizer must be the checkpoints' own."""
    if saved is None:
        if cfg.resume and tokenizer.to_json() is not None and _has_checkpoints(cfg):
            raise UsageError(
                f"--resume: --tokenizer {cfg.tokenizer_spec} does not match the checkpoints in "
                f"{cfg.ckpt_dir}, which were trained on bytes (no {TOKENIZER_FILE}); resume "
                "with --tokenizer byte or start a new run in another --ckpt-dir"
            )
        return
    if tokenizer.to_json() != saved.read_text():
        raise UsageError(
            f"--resume: --tokenizer {cfg.tokenizer_spec} does not match {saved}, the tokenizer the "
            f"checkpoints were trained with; resume with --tokenizer {saved} (or the spec the "
            "run started with) or start a new run in another --ckpt-dir"
        )


def _has_checkpoints(cfg) -> bool:
    folder = pathlib.Path(cfg.ckpt_dir)
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def _saved_tokenizer(cfg) -> pathlib.Path | None:
    if not cfg.ckpt_dir:
        return None
    path = pathlib.Path(cfg.ckpt_dir) / TOKENIZER_FILE
    return path if path.is_file() else None
