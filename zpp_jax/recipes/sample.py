"""What `zpp sample` runs: text from a trained model, decoded token by
token with a key/value cache.

`generate` works on any model that says how it decodes
(``pipeline_decoder()``, as `zpp_jax.models`' GPT and Llama do): the prompt
runs once, filling each layer's cache, then each new token runs alone and
attends to the cache. Greedy (temperature 0) picks the likeliest token,
exactly what the full forward pass would; a temperature samples.
`sample_run` restores a run's checkpoint and its tokenizer around it.

Memory: the model whole on the device (a sharded one is unsharded first)
and a cache of 2 x layers x seq_len x kv_width per sequence.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zpp_jax.errors import UsageError, read_json_object
from zpp_jax.pipeline.decoders import decoder_for, split_part

# Ids `zpp sample` writes at most when not told.
DEFAULT_MAX_TOKENS = 64


def generate(
    model: nnx.Module,
    prompt,
    max_tokens: int | None = None,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
) -> np.ndarray:
    """Up to `max_tokens` ids that follow `prompt` (a 1-D sequence of ids),
    stopping after `eos_id` (or any of several); None: `tokens_to_write`'s
    default. Two compiled programs: the prompt's pass and one token's step.

    Raises:
      UsageError: an empty prompt, a negative temperature, or a prompt and
        `max_tokens` longer together than the model's sequence.
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    decoder = decoder_for(model)
    if not prompt.size:
        raise UsageError("the prompt has no tokens")
    if temperature < 0:
        raise UsageError(f"--temperature {temperature}: use 0 (greedy) or more")
    max_tokens = tokens_to_write(prompt.size, max_tokens, decoder.seq_len)
    graph = {name: split_part(part) for name, part in decoder.parts(model).items()}
    defs = {name: g[0] for name, g in graph.items()}
    arrays = {name: (g[1], g[2]) for name, g in graph.items()}
    forward = jax.jit(functools.partial(_forward, decoder, defs))
    n_layers = jax.tree.leaves(arrays["blocks"][0])[0].shape[0]
    cache = [jnp.zeros((2, 1, decoder.seq_len, decoder.kv_width), decoder.dtype)] * n_layers
    logits, cache = forward(arrays, cache, jnp.asarray(prompt[None]), jnp.int32(0))
    key, out = jax.random.key(seed), []
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    for i in range(max_tokens):
        token = _pick(logits[0], temperature, jax.random.fold_in(key, i))
        out.append(token)
        if token in stops or i + 1 == max_tokens:
            break
        step = jnp.asarray([[token]], jnp.int32)
        logits, cache = forward(arrays, cache, step, jnp.int32(prompt.size + i))
    return np.asarray(out, np.int32)


def _forward(decoder, defs, arrays, cache, tokens, start):
    """The last position's logits of `tokens` at positions start.., and
    the caches with their keys and values written. The layers come
    stacked (`split_part`): layer i is merged from the stack's row i."""
    parts = {name: nnx.merge(defs[name], *arrays[name]) for name in defs if name != "blocks"}
    x = decoder.embed(parts, tokens, start)
    stack, rest = arrays["blocks"]
    written = []
    for i, kv in enumerate(cache):
        block = nnx.merge(defs["blocks"], jax.tree.map(lambda a, i=i: a[i], stack), rest)
        x, kv = decoder.layer(block, x, kv, start, decoder.seq_len)
        written.append(kv)
    return decoder.head(parts, x[:, -1:])[:, -1], written


def _pick(logits: jax.Array, temperature: float, key) -> int:
    if temperature == 0:
        return int(jnp.argmax(logits))
    return int(jax.random.categorical(key, logits.astype(jnp.float32) / temperature))


def _prompt_ids(
    directory: pathlib.Path, tokenizer, prompt: str, chat: bool, template
) -> np.ndarray:
    """The prompt's ids: its text with the tokenizer's added tokens, or with
    `chat`, the run's chat `template`'s rendering of it as a user's message
    (a `ChatTemplate`; None where the run has none)."""
    if not chat:
        return tokenizer.encode_text(prompt, special=True)
    if template is None:
        raise UsageError(
            f"--chat: --ckpt-dir {directory} has no chat template (tokenizer_config.json's "
            "chat_template, or chat_template.jinja): a run from a checkpoint with one keeps it"
        )
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode_text(text)  # the template writes the special tokens


def _stop_ids(directory: pathlib.Path, tokenizer, template) -> set[int]:
    """The ids that end a reply: config.json's and generation_config.json's
    ``eos_token_id`` (an id or a list) and the chat `template`'s end token."""
    stops = set()
    for name in ("config.json", "generation_config.json"):
        if (directory / name).is_file():
            value = read_json_object(directory / name).get("eos_token_id")
            stops.update(
                v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)
            )
    if template is not None and template.eos_token:
        end = tokenizer.token_id(template.eos_token)
        stops.update([] if end is None else [end])
    return stops


def _check_bytes_run(directory: pathlib.Path, step: int) -> None:
    """Raise UsageError unless the run in `directory` encoded its text as
    bytes (its checkpoint `step`, which is there): a run whose
    tokenizer.json is gone would decode as garbage."""
    from zpp_jax.checkpoint import Checkpointer

    if Checkpointer(directory).read_meta(step)["identity"]["tokenizer"].get("sha256"):
        raise UsageError(
            f"--ckpt-dir {directory} has no tokenizer.json, and its run encoded text with one: "
            "copy that tokenizer.json back there"
        )


def sample_run(
    ckpt_dir: str,
    prompt: str,
    max_tokens: int | None = None,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    step: int | None = None,
    chat: bool = False,
) -> str:
    """The text the model of a run's checkpoint writes after `prompt`,
    encoded and decoded with the run's tokenizer (its tokenizer.json, or
    bytes), stopping at an end-of-sequence id (its config.json's and
    generation_config.json's). With `chat`, `prompt` is a user's message,
    rendered with the checkpoint's chat template up to the assistant's
    turn, and the text is the reply, ended also by the template's end of
    turn. At most `max_tokens` ids are written; None: `DEFAULT_MAX_TOKENS`,
    or fewer where the model's positions end.

    Raises:
      UsageError: a missing run or checkpoint, a tokenizer.json gone, `chat`
        without a chat template, a prompt that fills the model's positions,
        or a `max_tokens` past them.
    """
    from zpp_jax.data.chat import load_chat_template
    from zpp_jax.data.tokenizer import ByteTokenizer, load_tokenizer
    from zpp_jax.hf.config import read_config
    from zpp_jax.hf.model import llama_config
    from zpp_jax.recipes.export import checkpoint_step, restore_run_model
    from zpp_jax.recipes.runs import CONFIG_FILE
    from zpp_jax.sharded import unshard

    directory = pathlib.Path(ckpt_dir)
    step = checkpoint_step(directory, step)
    file = directory / "tokenizer.json"
    if not file.is_file():
        _check_bytes_run(directory, step)
    tokenizer = load_tokenizer(file) if file.is_file() else ByteTokenizer()
    template = load_chat_template(directory)  # read once, for the prompt and the stops
    ids = _prompt_ids(directory, tokenizer, prompt, chat, template)
    eos, length = _stop_ids(directory, tokenizer, template), None
    if (directory / CONFIG_FILE).is_file():  # a Llama: any length within its positions
        context = llama_config(read_config(directory)).seq_len
        max_tokens = tokens_to_write(len(ids), max_tokens, context)
        length = len(ids) + max_tokens
    model, _, _ = restore_run_model(directory, step, seq_len=length)
    out = generate(unshard(model), ids, max_tokens, temperature=temperature, seed=seed, eos_id=eos)
    return tokenizer.decode(out)


def tokens_to_write(prompt: int, max_tokens: int | None, context: int) -> int:
    """How many ids to write after a `prompt` of that many ids, within the
    model's `context` positions; `max_tokens` None: at most
    `DEFAULT_MAX_TOKENS`, fewer where the positions end.

    Raises:
      UsageError: a prompt that fills the context, or `max_tokens` past it.
    """
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, context - prompt)
        if max_tokens < 1:
            raise UsageError(
                f"a prompt of {prompt} tokens leaves no room in the model's context of "
                f"{context} positions: use a shorter prompt"
            )
    if prompt + max_tokens > context:
        raise UsageError(
            f"a prompt of {prompt} tokens and {max_tokens} more exceed the model's "
            f"context of {context} positions: use fewer --max-tokens or a shorter prompt"
        )
    return max_tokens
