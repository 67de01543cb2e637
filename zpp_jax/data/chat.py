"""Chat data: conversations rendered with a checkpoint's own chat template,
the loss on what the assistant says.

A chat record is ``{"messages": [{"role": ..., "content": ...}, ...]}``, as
instruct models are fine-tuned on. It is rendered with the checkpoint's
template (``tokenizer_config.json``'s ``chat_template``, or a
``chat_template.jinja`` beside it: Jinja2, run as transformers runs it) and
cut into pieces at each assistant turn: the text the template writes before
the turn (with ``add_generation_prompt``, the assistant's header) and the
turn itself, which ends with the template's own end-of-turn token. The
model learns to write the assistant turns only.

Cost: the template renders twice per assistant turn (each conversation up
to and through that turn), in Python, once per record when a run starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib

from zpp_jax.errors import UsageError, read_json_object

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template (Jinja2 `source`) and the special
    tokens it may write (`bos_token`, `eos_token`), from `where`."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    where: str = "the chat template"

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, as ``apply_chat_template(...,
        tokenize=False)`` gives it.

        Raises:
          UsageError: the template fails, or raises (`raise_exception`) on
            these messages.
        """
        import jinja2

        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise UsageError(f"{self.where}: {e}") from None
        except UsageError as e:  # the template's raise_exception
            raise UsageError(f"{self.where} refuses the conversation: {e}") from None

    @functools.cached_property
    def _compiled(self):
        """The template compiled once, for every render of every record."""
        return _compiled(self.source)

    def pieces(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, the assistant's?)
        pieces: before each assistant turn, the text the template writes
        up to its generation prompt; the turn, what follows up to the end
        of that message. Joined, the pieces are `render(messages)`.

        Raises:
          UsageError: a template whose conversation up to a turn is not the
            start of the conversation through it (one that rewrites earlier
            turns), so that the turn cannot be found.
        """
        out, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (before.startswith(done) and through.startswith(before)):
                raise UsageError(
                    f"{self.where} renders the conversation up to message {i} as text that "
                    "the conversation through it does not start with, so the assistant's "
                    "turn cannot be told apart: use a template that appends each turn"
                )
            out += [(before[len(done) :], False), (through[len(before) :], True)]
            done = through
        whole = self.render(messages)
        if not whole.startswith(done):
            raise UsageError(f"{self.where}: the last assistant turn is not where it was rendered")
        if whole[len(done) :]:
            out.append((whole[len(done) :], False))
        return [(text, learned) for text, learned in out if text]


def _raise(message: str):
    raise UsageError(message)


def _compiled(source: str):
    """`source` compiled as transformers compiles a chat template: a
    sandbox, blocks trimmed, `raise_exception`, `tojson`, `strftime_now`."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, **kw)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def load_chat_template(directory: str | pathlib.Path) -> ChatTemplate | None:
    """The chat template of a checkpoint directory: its
    ``chat_template.jinja``, else its ``tokenizer_config.json``'s
    ``chat_template`` (a string, or named templates: the ``default`` one);
    None when it has neither."""
    directory = pathlib.Path(directory)
    config_file = directory / TOKENIZER_CONFIG
    config = read_json_object(config_file) if config_file.is_file() else {}
    tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
    if (directory / TEMPLATE_FILE).is_file():
        where = str(directory / TEMPLATE_FILE)
        return ChatTemplate((directory / TEMPLATE_FILE).read_text(), **tokens, where=where)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, **tokens, where=f"{config_file}'s chat_template")


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string, or
    ``{"content": ...}``."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
