"""Supervised fine-tuning examples: JSONL records, one sequence each, with
the loss on the tokens the model should learn to write.

A record is ``{"prompt": ..., "completion": ...}`` (the loss on the
completion's tokens only), ``{"text": ...}`` (the loss on every token) or
``{"messages": [{"role": ..., "content": ...}, ...]}`` (a conversation,
rendered with the checkpoint's chat template: the loss on the assistant's
turns; `zpp_jax.data.chat`). The prompt, or the text, is encoded with the
tokenizer's sequence tokens (a BOS, where the tokenizer adds one); the
completion without, followed by the end-of-sequence id when there is one;
a conversation as its template writes it, special tokens included. Each
example is one row of a batch: cut to ``seq_len + 1`` tokens, or padded
with weight 0.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from zpp_jax.data.chat import ChatTemplate
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
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(
                f"{file}: not UTF-8 text (byte {e.start}); JSONL is UTF-8: save it so"
            ) from None
        for number, line in enumerate(text.splitlines(), 1):
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
    kinds = ({"prompt", "completion"}, {"text"}, {"messages"})
    if not isinstance(record, dict) or set(record) not in kinds:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UsageError(
            f'{where}: a record is {{"prompt": ..., "completion": ...}}, {{"text": ...}} '
            f'or {{"messages": [{{"role": ..., "content": ...}}, ...]}}, got {keys}'
        )
    if "messages" in record:
        _check_messages(record["messages"], where)
    elif not all(isinstance(v, str) for v in record.values()):
        raise UsageError(f"{where}: the record's values must be strings")
    return record


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise UsageError(f'{where}: "messages" must be a non-empty list of messages')
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise UsageError(
                f'{where}: message {i} must be {{"role": "...", "content": "..."}} with '
                f"string values, got {m!r}"[:300]
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise UsageError(f'{where}: no "assistant" message, so nothing to learn')


def record_text(record: dict) -> str:
    """The text a record holds (a conversation's contents, one per line):
    what a tokenizer trained on the records sees."""
    if "messages" in record:
        return "\n".join(m["content"] for m in record["messages"])
    return "\n".join(record.values())


def encode_records(
    records: list[dict],
    tokenizer,
    eos_id: int | None,
    chat: ChatTemplate | None = None,
    max_tokens: int | None = None,
) -> list[tuple]:
    """Each record as (ids, learned): int32 token ids and a bool per id,
    True where the model should learn to write it. Conversations need
    `chat`, the checkpoint's template; each of its pieces is encoded on
    its own (`ChatTemplate.pieces`). With `max_tokens` (a row's tokens), a
    text is tokenized only as far as that many tokens can reach (the
    tokenizer's longest token, in characters, per token): a huge record
    costs memory for what a row uses, not for all of it.

    Raises:
      UsageError: a conversation without a chat template.
    """
    eos = np.asarray([] if eos_id is None else [eos_id], np.int32)
    if max_tokens is not None:
        chars = (max_tokens + 1) * max(1, int(np.max(tokenizer.token_bytes)))
        records = [_cut(record, chars) for record in records]
    out = []
    for record in records:
        if "messages" in record:
            ids, learned = _encoded_chat(record["messages"], tokenizer, chat)
        elif "text" in record:
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


def _cut(record: dict, chars: int) -> dict:
    """`record` with each text cut to `chars` characters."""
    if "messages" in record:
        return {"messages": [{**m, "content": m["content"][:chars]} for m in record["messages"]]}
    return {k: v[:chars] for k, v in record.items()}


def check_chat(records: list[dict], chat: ChatTemplate | None) -> None:
    """Raise UsageError if `records` hold a conversation and there is no
    chat template to render it with."""
    if chat is None and any("messages" in r for r in records):
        raise UsageError(
            'a {"messages": ...} record is a conversation, rendered with the checkpoint\'s chat '
            "template: --init a checkpoint whose tokenizer_config.json has a chat_template "
            "(or a chat_template.jinja), or write the records as prompt and completion"
        )


def _encoded_chat(messages: list[dict], tokenizer, chat: ChatTemplate | None) -> tuple:
    check_chat([{"messages": messages}], chat)
    # The template writes the special tokens (a BOS) itself.
    pieces = [(tokenizer.encode_text(text), learned) for text, learned in chat.pieces(messages)]
    ids = np.concatenate([ids for ids, _ in pieces]).astype(np.int32)
    learned = np.concatenate([np.full(len(ids), flag) for ids, flag in pieces])
    learned[:1] = False  # the first token is given, never predicted
    return ids, learned


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
