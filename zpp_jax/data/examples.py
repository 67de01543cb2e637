"""Supervised fine-tuning examples: JSONL records, one sequence each, with
the loss on the tokens the model should learn to write.

A record is ``{"prompt": ..., "completion": ...}`` (the loss on the
completion's tokens only) or ``{"text": ...}`` (the loss on every token).
The prompt, or the text, is encoded with the tokenizer's sequence tokens
(a BOS, where the tokenizer adds one); the completion without, followed by
the end-of-sequence id when there is one. Each example is one row of a
batch: cut to ``seq_len + 1`` tokens, or padded with weight 0.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from zpp_jax.errors import UsageError, count


def read_records(files: list[pathlib.Path]) -> list[dict]:
    """The records of JSONL files, each checked to be a prompt/completion
    pair or a text.

    Raises:
      UsageError: naming the file and line of a record that is not JSON or
        not one of the two kinds.
    """
    records = []
    for file in files:
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{file}:{number}: not JSON ({e.msg})") from None
            records.append(_checked(record, f"{file}:{number}"))
    if not records:
        raise UsageError(f"{', '.join(map(str, files))}: no records")
    return records


def _checked(record, where: str) -> dict:
    kinds = ({"prompt", "completion"}, {"text"})
    if not isinstance(record, dict) or set(record) not in kinds:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UsageError(
            f'{where}: a record is {{"prompt": ..., "completion": ...}} or '
            f'{{"text": ...}}, got {keys}'
        )
    if not all(isinstance(v, str) for v in record.values()):
        raise UsageError(f"{where}: the record's values must be strings")
    return record


def encode_records(records: list[dict], tokenizer, eos_id: int | None) -> list[tuple]:
    """Each record as (ids, learned): int32 token ids and a bool per id,
    True where the model should learn to write it."""
    eos = np.asarray([] if eos_id is None else [eos_id], np.int32)
    out = []
    for record in records:
        if "text" in record:
            ids = np.concatenate([tokenizer.encode_text(record["text"], special=True), eos])
            learned = np.ones(len(ids), bool)
            learned[:1] = False  # the first token is given, never predicted
        else:
            prompt = tokenizer.encode_text(record["prompt"], special=True)
            completion = np.concatenate([tokenizer.encode_text(record["completion"]), eos])
            ids = np.concatenate([prompt, completion])
            learned = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(completion), bool)])
        out.append((ids, learned))
    return out


class ExampleDataset:
    """Batches of examples: the `TokenDataset` interface (`batch`,
    `bytes_per_token`, `seq_len`, `splits`), with a third array.

    ``batch(...)`` gives {"inputs", "targets"} (int32) and "weights"
    (float32, 1 where a target is a learned token, 0 for prompt tokens and
    padding). Batch `index` of a split draws its examples as a pure function
    of (seed, split, index), so a run resumes exactly.
    """

    def __init__(
        self,
        train: list[tuple],
        val: list[tuple],
        seq_len: int,
        vocab_size: int | None = None,
        pad_id: int = 0,
    ):
        count(1, 2**31 - 2, "tokens per sequence").check("seq_len", seq_len)
        self.seq_len = seq_len
        self.splits = {"train": train, "val": val}
        self.truncated = {}
        for name, examples in self.splits.items():
            if not examples:
                raise UsageError(f"the {name} split has no examples")
            if not any(learned[1 : seq_len + 1].any() for _, learned in examples):
                raise UsageError(
                    f"no example of the {name} split has a completion token within the first "
                    f"{seq_len + 1} tokens: nothing to learn; use a longer --seq"
                )
            self.truncated[name] = sum(len(ids) > seq_len + 1 for ids, _ in examples)
            if vocab_size is not None:
                top = max(int(ids.max(initial=0)) for ids, _ in examples)
                if top >= vocab_size:
                    raise UsageError(
                        f"the {name} examples hold token id {top}, past the model's "
                        f"{vocab_size} ids: the tokenizer does not belong to the model"
                    )
        self.pad_id = pad_id

    def batch(
        self, split: str, index: int, batch_size: int, seed: int, rows=None
    ) -> dict[str, np.ndarray]:
        """{"inputs", "targets", "weights"} of shape (batch_size, seq_len);
        with `rows`, only those rows are filled (the others are padding)."""
        examples = self._split(split)
        count(why="sequences").check("batch_size", batch_size)
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        picks = rng.integers(0, len(examples), size=batch_size)
        n = self.seq_len + 1
        ids = np.full((batch_size, n), self.pad_id, np.int32)
        learned = np.zeros((batch_size, n), bool)
        for r in range(batch_size) if rows is None else rows:
            example_ids, example_learned = examples[int(picks[r])]
            k = min(n, len(example_ids))
            ids[r, :k], learned[r, :k] = example_ids[:k], example_learned[:k]
        return {
            "inputs": ids[:, :-1],
            "targets": ids[:, 1:],
            "weights": learned[:, 1:].astype(np.float32),
        }

    def bytes_per_token(self, split: str, token_bytes: np.ndarray) -> float:
        """Mean bytes per learned token of the split (for bits per byte);
        an id past `token_bytes` (one the model has and the tokenizer does
        not spell, such as an end-of-sequence id) counts no bytes."""
        total = tokens = 0
        for ids, learned in self._split(split):
            ids, learned = ids[1 : self.seq_len + 1], learned[1 : self.seq_len + 1]
            picked = ids[learned]
            total += int(token_bytes[picked[picked < len(token_bytes)]].sum())
            tokens += int(learned.sum())
        return total / max(tokens, 1)

    def _split(self, split: str) -> list[tuple]:
        if split not in self.splits:
            raise UsageError(f"no split {split!r}: an ExampleDataset has {sorted(self.splits)}")
        return self.splits[split]
