"""Decoding with a key/value cache (`zpp_jax.recipes.sample.generate`):
greedy decoding writes what the full forward pass would pick at each step."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zpp_jax.errors import UsageError
from zpp_jax.models import GPT, GPTConfig, Llama, LlamaConfig
from zpp_jax.recipes.sample import generate


def _full_pass_picks(model, prompt, written):
    """The reference: the whole sequence through the model once; the
    argmax after each prefix of the prompt and what was written."""
    logits = model(jnp.asarray([list(prompt) + list(written)], jnp.int32))
    return np.argmax(np.asarray(logits[0]), axis=-1)[len(prompt) - 1 : -1].tolist()


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "gpt"])
def test_greedy_decoding_is_the_full_pass_argmax(arch):
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=24)
        model = Llama(cfg, nnx.Rngs(1))
    else:
        cfg = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, seq_len=24)
        model = GPT(cfg, nnx.Rngs(1))
    prompt = [5, 9, 13, 2]
    got = generate(model, prompt, 12)
    assert len(got) == 12 and got.tolist() == _full_pass_picks(model, prompt, got)


@pytest.mark.slow  # greedy decoding stays in the loop
def test_sampling_follows_the_seed_and_stops_at_the_end_id():
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=24)
    model = Llama(cfg, nnx.Rngs(1))
    a = generate(model, [3, 4], 10, temperature=1.0, seed=0)
    assert generate(model, [3, 4], 10, temperature=1.0, seed=0).tolist() == a.tolist()
    assert generate(model, [3, 4], 10, temperature=1.0, seed=1).tolist() != a.tolist()
    greedy = generate(model, [3, 4], 10)
    stop = int(greedy[2])
    cut = generate(model, [3, 4], 10, eos_id=stop)
    assert cut.tolist() == greedy[: greedy.tolist().index(stop) + 1].tolist()
    with pytest.raises(UsageError, match="exceed the model's context of 24 positions: use fewer"):
        generate(model, np.arange(20), 5)
    # Not told how many: at most 64, and no more than the positions leave.
    assert len(generate(model, np.arange(20))) == 4
    with pytest.raises(UsageError, match="a prompt of 24 tokens leaves no room in the model's"):
        generate(model, np.arange(24))
