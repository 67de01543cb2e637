"""Fine-tuning a Hugging Face checkpoint: `zpp train --init` on JSONL
examples (the loss on completions only), the run identity holding the
checkpoint, and the flags that contradict it refused."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import zpp_jax as zpp
from zpp_jax import hf
from zpp_jax.cli import main
from zpp_jax.data.chat import load_chat_template
from zpp_jax.data.examples import ExampleDataset, encode_records, read_records
from zpp_jax.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from zpp_jax.errors import UsageError
from zpp_jax.lora import add_lora
from zpp_jax.models import Llama, LlamaConfig
from zpp_jax.recipes import RunConfig
from zpp_jax.recipes import corpus as run_corpus
from zpp_jax.recipes.sample import generate
from zpp_jax.train import cross_entropy

EOS = 299
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _records(n=48):
    out = []
    for i in range(n):
        a, b = i % 10, (3 * i) % 10
        out.append({"prompt": f"add {WORDS[a]} and {WORDS[b]}:", "completion": f" {a + b}"})
    return out


# What a published checkpoint has beside its weights and tokenizer.json.
COMPANIONS = {
    "tokenizer_config.json": {
        "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    },
    "special_tokens_map.json": {"eos_token": "<eos>"},
    "generation_config.json": {"eos_token_id": EOS, "temperature": 0.6},
}


def write_finetune(directory, seed=0):
    """A tiny Llama checkpoint with a BPE tokenizer.json, and JSONL data."""
    text = " ".join(f"{r['prompt']}{r['completion']}" for r in _records()).encode() * 4
    tokenizer = train_bpe(text, 296)
    cfg = LlamaConfig(vocab_size=304, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, seq_len=64)
    hf.save(Llama(cfg, nnx.Rngs(seed)), directory / "ckpt", extra={"eos_token_id": EOS})
    tokenizer.save(directory / "ckpt" / "tokenizer.json")
    for name, content in COMPANIONS.items():
        (directory / "ckpt" / name).write_text(json.dumps(content))
    lines = "\n".join(json.dumps(r) for r in _records())
    (directory / "data.jsonl").write_text(lines + "\n")
    return directory / "ckpt", directory / "data.jsonl"


def test_examples_weigh_the_completion_tokens_only():
    records = [{"prompt": "ab", "completion": "cd"}, {"text": "xyz"}]
    (ids, learned), (text_ids, text_learned) = encode_records(records, ByteTokenizer(), 7)
    np.testing.assert_array_equal(ids, [97, 98, 99, 100, 7])
    np.testing.assert_array_equal(learned, [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(text_learned, [0, 1, 1, 1])
    data = ExampleDataset([(ids, learned)], [(text_ids, text_learned)], seq_len=6)
    batch = data.batch("train", 0, 2, seed=0)
    np.testing.assert_array_equal(batch["inputs"][0], [97, 98, 99, 100, 7, 0])
    np.testing.assert_array_equal(batch["targets"][0], [98, 99, 100, 7, 0, 0])
    np.testing.assert_array_equal(batch["weights"][0], [0, 1, 1, 1, 0, 0])
    # The weighted loss is the mean over the learned targets alone.
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 256)), jnp.float32)
    weights = jnp.asarray(batch["weights"][:1])
    targets = jnp.asarray(batch["targets"][:1])
    nll = -jnp.take_along_axis(jax_log_softmax(logits), targets[..., None], -1)[..., 0]
    want = float(nll[0, 1:4].mean())
    assert float(cross_entropy(logits, targets, weights)) == pytest.approx(want, rel=1e-6)


def test_empty_completions_learn_their_eos_and_have_no_bits_per_byte():
    """An empty completion still learns its EOS; its learned tokens hold no
    bytes, so the run reports no bits per byte (not a division by 0)."""
    records = [{"prompt": "ab", "completion": ""}] * 2
    (ids, learned), _ = encode_records(records, ByteTokenizer(), 300)  # EOS: no bytes
    np.testing.assert_array_equal(learned, [0, 0, 1])
    data = ExampleDataset([(ids, learned)], [(ids, learned)], seq_len=6)
    per_token = run_corpus.bytes_per_token(data, ByteTokenizer())
    assert per_token == 0 and run_corpus.bits_per_byte(2.0, per_token) is None
    assert run_corpus.bits_per_byte(2.0, 0.5) == pytest.approx(4 / np.log(2))


def jax_log_softmax(x):
    import jax

    return jax.nn.log_softmax(x, axis=-1)


def test_bad_records_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"question": "a"}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2: a record is .*got \['question'\]"):
        read_records([bad])
    bad.write_text("{not json\n")
    with pytest.raises(UsageError, match="bad.jsonl:1: not JSON"):
        read_records([bad])


def _train(tmp_path, ckpt, data, *extra):
    args = ["train", "--init", str(ckpt), "--data", str(data), "--quiet", "--seq", "24"]
    args += ["--batch", "8", "--steps", "6", "--eval-every", "0", "--lr", "1e-2", "--warmup", "1"]
    args += ["--zero3", "--comm-dtype", "float32", "--compute-dtype", "float32"]
    return main([*args, *extra])


@pytest.mark.slow  # training runs
def test_train_from_a_checkpoint_starts_from_its_weights(tmp_path, capfd):
    """The first step's loss is the checkpoint's own loss on the first batch
    (the weights, tokenizer and completion-only weights all as loaded), in
    ZeRO-3's exact mode; the loss falls; the identity holds the checkpoint."""
    ckpt, data = write_finetune(tmp_path)
    metrics = tmp_path / "m.jsonl"
    assert (
        _train(tmp_path, ckpt, data, "--metrics", str(metrics), "--ckpt-dir", str(tmp_path / "run"))
        == 0
    )
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    cfg = RunConfig(init=str(ckpt), data=str(data), seq_len=24, batch=8)
    examples = run_corpus.load(cfg)
    batch = examples.dataset(24, 304).batch("train", 0, 8, seed=0)
    assert batch["weights"].sum() > 0 and (batch["inputs"][:, 0] == batch["inputs"][0, 0]).all()
    model = hf.load(ckpt, seq_len=24)
    want = cross_entropy(model(jnp.asarray(batch["inputs"])), batch["targets"], batch["weights"])
    assert losses[0] == pytest.approx(float(want), rel=1e-5)
    assert losses[-1] < losses[0]
    _check_export(tmp_path, examples.dataset(24, 304), metrics, capfd)
    # --resume with another checkpoint is refused: the identity holds the first.
    other, _ = write_finetune(tmp_path / "other", seed=1)
    capfd.readouterr()
    code = main(
        ["train", "--init", str(other), "--data", str(data), "--quiet", "--seq", "24"]
        + ["--batch", "8", "--steps", "7", "--eval-every", "0", "--lr", "1e-2", "--warmup", "1"]
        + ["--zero3", "--comm-dtype", "float32", "--compute-dtype", "float32"]
        + ["--ckpt-dir", str(tmp_path / "run"), "--resume"]
    )
    err = capfd.readouterr().err
    assert code == 2 and "init.sha256" in err, err


def _check_export(tmp_path, data, metrics, capfd):
    """zpp export writes the trained weights: the exported checkpoint's
    validation loss is the one the run reported at its last step; the
    tokenizer, its configuration and chat template, the generation
    defaults and the checkpoint's config.json come along (its 64 positions,
    not the run's 24-token sequences; only the dtype is the export's); a
    non-empty output is refused. zpp sample decodes past the run's
    sequence length, within the checkpoint's positions."""
    out = tmp_path / "exported"
    run = str(tmp_path / "run")
    base = ["--base", str(tmp_path / "ckpt")]
    assert main(["export", "--ckpt-dir", run, "--hf", str(out), *base]) == 2
    assert "this run trained every weight: drop --base" in capfd.readouterr().err
    (tmp_path / "a-file").write_text("mine")
    for flags, message in (
        (["--hf", str(out), "--merge-onto", "codes"], "trained every weight: drop --merge-onto"),
        (["--hf", str(tmp_path / "ckpt"), "--overwrite"], "is the run's --init, which --over"),
        (["--hf", run, "--overwrite"], "is the run's --ckpt-dir, which --overwrite does not"),
        (["--hf", str(tmp_path / "a-file")], "is a file: name the directory to write"),
    ):
        assert main(["export", "--ckpt-dir", run, *flags]) == 2
        err = capfd.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert (tmp_path / "a-file").read_text() == "mine" and not out.exists()
    assert main(["export", "--ckpt-dir", run, "--hf", str(out), "--dtype", "float32"]) == 0
    last = json.loads(metrics.read_text().splitlines()[-1])
    model = hf.load(out, seq_len=24)
    losses = []
    for i in range(4):  # --eval-batches 4
        batch = data.batch("val", i, 8, seed=0)
        logits = model(jnp.asarray(batch["inputs"]))
        losses.append(float(cross_entropy(logits, batch["targets"], batch["weights"])))
    assert np.mean(losses) == pytest.approx(last["val_loss"], rel=1e-5)
    exported = json.loads((out / "config.json").read_text())
    original = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert exported["eos_token_id"] == EOS and exported["max_position_embeddings"] == 64
    assert exported == {**original, "torch_dtype": "float32"}
    for name in ("tokenizer.json", *COMPANIONS):
        assert (out / name).read_text() == (tmp_path / "ckpt" / name).read_text(), name
    capfd.readouterr()
    assert main(["export", "--ckpt-dir", run, "--hf", str(out)]) == 2
    assert "is not empty: write into a new directory, or pass --overwrite" in capfd.readouterr().err
    # zpp sample decodes what the exported model writes, greedily, past the
    # run's 24 tokens.
    prompt = "add two and three:"
    tokenizer = load_tokenizer(out / "tokenizer.json")
    ids = tokenizer.encode_text(prompt, special=True)
    more = 40 - len(ids)
    assert main(["sample", "--ckpt-dir", run, "--prompt", prompt, "--max-tokens", str(more)]) == 0
    want = generate(hf.load(out), ids, more, eos_id=EOS)
    assert capfd.readouterr().out == prompt + tokenizer.decode(want) + "\n"
    assert main(["sample", "--ckpt-dir", run, "--prompt", prompt, "--max-tokens", "60"]) == 2
    assert "more exceed the model's context of 64 positions" in capfd.readouterr().err
    # Not told how many, it writes what the 64 positions leave: the greedy
    # reply, as long as the model's own ids make it.
    assert main(["sample", "--ckpt-dir", run, "--prompt", prompt]) == 0
    want = generate(hf.load(out), ids, 64 - len(ids), eos_id=EOS)
    assert capfd.readouterr().out == prompt + tokenizer.decode(want) + "\n"
    # A step that is not there is named before anything is built.
    assert main(["sample", "--ckpt-dir", run, "--prompt", prompt, "--step", "5"]) == 2
    assert f"--ckpt-dir {run}: no checkpoint 5; it holds checkpoints [" in capfd.readouterr().err
    # The --init checkpoint given for the run's directory.
    assert main(["sample", "--ckpt-dir", str(tmp_path / "ckpt"), "--prompt", prompt]) == 2
    assert "it holds none (it holds a Hugging Face checkpoint: pass" in capfd.readouterr().err
    # Without its tokenizer.json the run cannot decode: refused, not bytes.
    saved = tmp_path / "run" / "tokenizer.json"
    saved.rename(tmp_path / "aside.json")
    assert main(["sample", "--ckpt-dir", run, "--prompt", prompt]) == 2
    assert "has no tokenizer.json, and its run encoded text with one" in capfd.readouterr().err
    (tmp_path / "aside.json").rename(saved)
    # --chat on a run whose checkpoint had no chat template.
    (tmp_path / "run" / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    assert main(["sample", "--ckpt-dir", run, "--prompt", prompt, "--chat"]) == 2
    assert f"--chat: --ckpt-dir {run} has no chat template" in capfd.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "tiny"], "so --model would contradict it; drop it"),
        (["--arch", "llama", "--tokenizer", "byte"], "so --arch, --tokenizer would contradict"),
        (["--seq", "65"], "checkpoint's 64 positions (max_position_embeddings): use a sequence"),
    ],
)
def test_flags_that_contradict_the_checkpoint_are_refused(tmp_path, capfd, flags, message):
    ckpt, data = write_finetune(tmp_path)
    code = main(["train", "--init", str(ckpt), "--data", str(data), *flags])
    err = capfd.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_without_a_tokenizer_or_config_is_refused(tmp_path, capfd):
    ckpt, data = write_finetune(tmp_path)
    (ckpt / "tokenizer.json").unlink()
    assert main(["train", "--init", str(ckpt), "--data", str(data)]) == 2
    assert "has no tokenizer.json" in capfd.readouterr().err
    assert main(["train", "--init", str(tmp_path / "nothing"), "--data", str(data)]) == 2
    assert "a Hugging Face checkpoint has a config.json" in capfd.readouterr().err


@pytest.mark.slow
def test_a_lora_run_trains_adapters_and_exports_them_merged(tmp_path, capfd):
    """zpp train --lora over the checkpoint (an int8 base, alpha 8 on rank
    4): the metrics carry the state bytes per device. The export merges
    the adapters: by default onto the base checkpoint's own kernels (each
    is the base's plus 2 a @ b), with --merge-onto codes onto the codes the
    run computed with, whose validation loss is the run's last (to the
    rounding of fp32 sums in another order). Every tensor no adapter wraps
    is the checkpoint's own either way. A base that moved, or another
    checkpoint, is refused."""
    ckpt, data = write_finetune(tmp_path)
    metrics, run = tmp_path / "m.jsonl", str(tmp_path / "run")
    extra = ["--lora", "4", "--lora-alpha", "8", "--metrics", str(metrics), "--ckpt-dir", run]
    assert _train(tmp_path, ckpt, data, *extra) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0]["state_bytes_per_device"] > 0
    assert records[-1]["loss"] < records[0]["loss"]
    out, trained = tmp_path / "exported", tmp_path / "trained"
    export = ["export", "--ckpt-dir", run, "--dtype", "float32"]
    assert main([*export, "--hf", str(out)]) == 0
    assert main([*export, "--hf", str(trained), "--merge-onto", "codes"]) == 0
    _check_trained_loss(trained, ckpt, data, records[-1]["val_loss"])
    _check_merged_onto_the_base(out, ckpt, run)
    # What no adapter wraps (the embedding, the norms, the LM head) is the
    # checkpoint's own, bit for bit: only the adapted kernels were codes.
    base = load_file(ckpt / "model.safetensors")
    for exported in (
        load_file(out / "model.safetensors"),
        load_file(trained / "model.safetensors"),
    ):
        untouched = [name for name in base if "_proj." not in name]
        assert len(untouched) == 2 * 2 + 3 and set(exported) == set(base)
        for name in untouched:
            np.testing.assert_array_equal(exported[name], base[name], err_msg=name)
    capfd.readouterr()
    other, _ = write_finetune(tmp_path / "other", seed=1)
    assert main([*export, "--hf", str(tmp_path / "y"), "--base", str(other)]) == 2
    assert "is not the checkpoint this run started from" in capfd.readouterr().err
    ckpt.rename(tmp_path / "moved")
    assert main([*export, "--hf", str(tmp_path / "y")]) == 2
    assert "the run's base checkpoint" in capfd.readouterr().err
    assert main([*export, "--hf", str(tmp_path / "y"), "--base", str(tmp_path / "moved")]) == 0
    capfd.readouterr()
    for base, message in (
        (data, "is not a Hugging Face checkpoint's directory (no config.json there)"),
        (tmp_path / "nowhere", "is not a Hugging Face checkpoint's directory"),
    ):
        assert main([*export, "--hf", str(tmp_path / "z"), "--base", str(base)]) == 2
        assert message in capfd.readouterr().err
    codes = ["--hf", str(tmp_path / "z"), "--merge-onto", "codes", "--base", str(other)]
    assert main([*export, *codes]) == 2
    assert "--merge-onto codes reads none: drop one" in capfd.readouterr().err
    assert not (tmp_path / "z").exists()
    assert main(["export", "--ckpt-dir", run, "--hf", str(tmp_path / "x"), "--step", "7"]) == 2
    assert "no checkpoint 7; it holds checkpoints [6]" in capfd.readouterr().err
    moved = tmp_path / "moved"
    assert main(["train", "--init", str(moved), "--data", str(data), "--lora", "0"]) == 2
    assert "--lora: must be an int from 1" in capfd.readouterr().err
    assert main(["train", "--init", str(moved), "--data", str(data), "--lora-targets", "q"]) == 2
    assert "--lora-targets names the layers --lora adapts" in capfd.readouterr().err


def _check_trained_loss(out, ckpt, data, val_loss):
    cfg = RunConfig(init=str(ckpt), data=str(data), seq_len=24, batch=8)
    data_set = run_corpus.load(cfg).dataset(24, 304)
    model = hf.load(out, seq_len=24)
    losses = []
    for i in range(4):
        batch = data_set.batch("val", i, 8, seed=0)
        logits = model(jnp.asarray(batch["inputs"]))
        losses.append(float(cross_entropy(logits, batch["targets"], batch["weights"])))
    assert np.mean(losses) == pytest.approx(val_loss, rel=1e-5)


def _check_merged_onto_the_base(out, ckpt, run):
    """Each adapted kernel of `out` is the base checkpoint's plus
    alpha / rank (2) times its adapters' a @ b, to fp32 rounding."""
    from zpp_jax.recipes.export import restore_run_model

    model, _, _ = restore_run_model(run)
    adapters = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    merged = dict(nnx.to_flat_state(nnx.state(hf.load(out), nnx.Param)))
    base = dict(nnx.to_flat_state(nnx.state(hf.load(ckpt), nnx.Param)))
    layers = {path[:-1] for path in adapters}
    assert len(layers) == 2 * 7
    for layer in layers:
        a = np.asarray(adapters[(*layer, "lora_a")].get_value())
        b = np.asarray(adapters[(*layer, "lora_b")].get_value())
        kernel = (*layer, "kernel")
        want = base[kernel].get_value() + 2.0 * (a @ b)
        np.testing.assert_allclose(merged[kernel].get_value(), want, rtol=0, atol=1e-6)


def test_a_broken_checkpoint_is_refused_before_anything_is_written(tmp_path, capfd):
    """A tensor whose shape config.json does not imply, an index naming a
    missing shard, an unsupported architecture: one line, exit status 2,
    and neither the checkpoint directory nor the metrics file exists."""
    ckpt, data = write_finetune(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    cases = {
        "shape": {**config, "intermediate_size": 96},
        "architecture": {**config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
    }
    run, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    for case, broken in cases.items():
        (ckpt / "config.json").write_text(json.dumps(broken))
        code = main(
            ["train", "--init", str(ckpt), "--data", str(data), "--ckpt-dir", str(run)]
            + ["--metrics", str(metrics)]
        )
        err = capfd.readouterr().err
        assert code == 2 and err.startswith("zpp train: error: --init: "), (case, err)
        assert err.count("\n") == 1 and not run.exists() and not metrics.exists(), (case, err)
    assert "gate_proj.weight has shape (64, 32), but config.json implies (96, 32)" in (
        _refusal(ckpt, data, cases["shape"], capfd)
    )
    (ckpt / "config.json").write_text(json.dumps(config))
    hf.save(hf.load(ckpt), tmp_path / "sharded", max_shard_bytes=8192)
    (tmp_path / "sharded" / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text())
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    code = main(["train", "--init", str(tmp_path / "sharded"), "--data", str(data)])
    err = capfd.readouterr().err
    assert code == 2 and f"names the shard {shard.name}, which does not exist" in err


def _refusal(ckpt, data, config, capfd) -> str:
    (ckpt / "config.json").write_text(json.dumps(config))
    main(["train", "--init", str(ckpt), "--data", str(data)])
    return capfd.readouterr().err


def test_lora_and_export_mistakes_are_one_line_each(tmp_path, capfd):
    """Each mistake exits 2 with one line that names it and the fix, and
    nothing is written."""
    ckpt, data = write_finetune(tmp_path)
    base = ["train", "--init", str(ckpt), "--data", str(data), "--ckpt-dir", str(tmp_path / "r")]
    cases = [
        ([*base, "--frozen-bits", "4"], "--frozen-bits sets how the frozen kernels --lora adapts"),
        ([*base, "--lora-alpha", "16"], "--lora-alpha scales the adapters --lora trains"),
        ([*base, "--lora", "4", "--lora-alpha", "0"], "--lora-alpha: must be"),
        (
            [*base, "--lora", "1000"],
            "LoRA rank 1000 is more than the 16 features of the narrowest layer it adapts",
        ),
        (
            [*base, "--lora", "4", "--lora-targets", "foo"],
            "no linear layer named foo in Llama: name the model's nnx.Linear attributes to "
            "adapt with --lora-targets (it has down, gate, k, lm_head, o, q, up, v)",
        ),
        (
            ["train", "--init", str(ckpt / "model.safetensors"), "--data", str(data)],
            "is a file of the checkpoint, not its config.json: pass the checkpoint's directory",
        ),
        (
            ["export", "--ckpt-dir", str(tmp_path / "missing"), "--hf", str(tmp_path / "o")],
            f"--ckpt-dir {tmp_path / 'missing'} does not exist",
        ),
        (
            ["sample", "--ckpt-dir", str(tmp_path / "missing"), "--prompt", "a"],
            f"--ckpt-dir {tmp_path / 'missing'} does not exist",
        ),
    ]
    cases += _damaged_inputs(tmp_path, ckpt, data, base)
    for args, message in cases:
        code = main(args)
        err = capfd.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
    assert not (tmp_path / "r").exists() and not (tmp_path / "missing").exists()
    assert not (tmp_path / "o").exists()
    with pytest.raises(UsageError, match="pass a sequence of attribute names"):
        add_lora(Llama(LlamaConfig(), nnx.Rngs(0)), 4, targets="gate")
    with pytest.raises(UsageError, match=r"name no layer: .* \(it has down, gate, k, lm_head"):
        add_lora(Llama(LlamaConfig(), nnx.Rngs(0)), 4, targets=[])
    with pytest.raises(UsageError, match="freeze=42 is not an NNX filter"):
        zpp.shard(Llama(LlamaConfig(), nnx.Rngs(0)), zpp.make_mesh(2, 4), freeze=42)
    with pytest.raises(UsageError, match="is not an NNX filter: .* a predicate \\(path, var"):
        zpp.shard(Llama(LlamaConfig(), nnx.Rngs(0)), zpp.make_mesh(2, 4), freeze=lambda p: True)
    adapted = add_lora(Llama(LlamaConfig(), nnx.Rngs(0)), 4)
    with pytest.raises(UsageError, match="Llama has LoRA adapters already .add_lora ran on it"):
        add_lora(adapted, 4)
    with pytest.raises(UsageError, match="save zpp_jax.lora.merge_lora.model."):
        hf.save(adapted, tmp_path / "adapted")
    assert not (tmp_path / "adapted").exists()


def _damaged_inputs(tmp_path, ckpt, data, base):
    """(arguments, message) of a checkpoint or data damaged each in its own
    way, in copies of `ckpt` and `data`."""
    out = []

    def copy(name, change):
        target = tmp_path / name
        shutil.copytree(ckpt, target)
        change(target)
        return ["train", "--init", str(target), "--data", str(data)]

    def cut(d):
        weights = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])

    def lfs(d):
        (d / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid x\n")

    def config(**changes):
        def change(d):
            data = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**data, **changes}))

        return change

    out.append((copy("cut", cut), "cannot be read as safetensors"))
    out.append((copy("lfs", lfs), "is a git-lfs pointer, not the weights: fetch them"))
    out.append((copy("eps", config(rms_norm_eps="x")), "rms_norm_eps must be a positive number"))
    out.append(
        (
            copy("nan", config(rms_norm_eps=float("nan"))),
            "rms_norm_eps must be a positive number, got nan",
        )
    )

    def weights(change):
        def rewrite(d):
            tensors = load_file(d / "model.safetensors")
            name = "model.layers.0.self_attn.q_proj.weight"
            tensors[name] = change(tensors[name])
            save_file(tensors, d / "model.safetensors")

        return rewrite

    quantized = copy("int", weights(lambda w: w.astype(np.int8)))
    out.append((quantized, "q_proj.weight is stored as I8; zpp_jax.hf reads floating-point"))
    nan = copy("nan-weight", weights(lambda w: w * np.nan))
    out.append((nan, "q_proj.weight holds NaN or infinite values: the checkpoint is damaged"))
    generation = copy("gen", lambda d: (d / "generation_config.json").write_text("{oops"))
    out.append((generation, "generation_config.json is not JSON (Expecting property name"))
    array = tmp_path / "records.json"
    array.write_text(json.dumps(_records()))
    json_data = ["train", "--init", str(ckpt), "--data", str(array)]
    out.append((json_data, "records.json: a .json file; fine-tuning examples are JSON Lines"))
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    out.append(
        (
            ["train", "--init", str(ckpt), "--data", str(latin)],
            "not UTF-8 text (byte 13); JSONL is UTF-8",
        )
    )
    targets = [*base, "--lora", "4", "--lora-targets", "q,v,gatee"]
    out.append((targets, "no linear layer named gatee in Llama"))
    empty = [*base, "--lora", "4", "--lora-targets", " , "]
    out.append((empty, "--lora-targets ' , ' names no layer: give the linear layers to adapt"))
    tune = ["tune", "--model", "tiny", "--out", str(tmp_path / "no" / "t.json")]
    out.append((tune, f"the directory {tmp_path / 'no'} does not exist"))
    (tmp_path / "plain").mkdir()
    empty = ["sample", "--ckpt-dir", str(tmp_path / "plain"), "--prompt", "hi", "--chat"]
    out.append((empty, f"--ckpt-dir {tmp_path / 'plain'}: no checkpoint; it holds none"))
    return out


def test_an_overwritten_export_leaves_no_shard_of_the_old_one(tmp_path):
    """hf.save over a sharded save writes one file and deletes the old
    shards and index, so that a load reads the new weights; other files
    stay."""
    model = Llama(LlamaConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64), nnx.Rngs(0))
    hf.save(model, tmp_path, max_shard_bytes=8_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    (tmp_path / "notes.txt").write_text("mine")
    other = Llama(LlamaConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64), nnx.Rngs(1))
    hf.save(other, tmp_path, overwrite=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "model.safetensors", "notes.txt"]
    loaded = hf.load(tmp_path)
    np.testing.assert_array_equal(loaded.embed.embedding[...], other.embed.embedding[...])


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHAT_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _conversation(a, b):
    return [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": f"add {WORDS[a]} and {WORDS[b]}"},
        {"role": "assistant", "content": f"{a + b}"},
        {"role": "user", "content": "and twice that?"},
        {"role": "assistant", "content": f"{2 * (a + b)}"},
    ]


def write_chat(directory):
    """A tiny Llama checkpoint with a Llama-3-style chat template and BPE
    (its special tokens ids 0-3), and conversations as JSONL."""
    conversations = [_conversation(i % 10, (3 * i) % 10) for i in range(24)]
    text = " ".join(m["content"] for c in conversations for m in c).encode() * 4
    tokenizer = train_bpe(text, 300, special_tokens=CHAT_SPECIALS)
    cfg = LlamaConfig(vocab_size=304, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, seq_len=64)
    ckpt = directory / "chat-ckpt"
    hf.save(Llama(cfg, nnx.Rngs(0)), ckpt, extra={"bos_token_id": 0, "eos_token_id": 3})
    tokenizer.save(ckpt / "tokenizer.json")
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config["chat_template"] = CHAT_TEMPLATE
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    data = directory / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return ckpt, data, tokenizer


def test_a_conversation_learns_the_assistant_turns_alone(tmp_path):
    """A {"messages": ...} record is its chat template's text, token for
    token, and the tokens learned are exactly each assistant turn (its
    content and end-of-turn token)."""
    ckpt, _, tokenizer = write_chat(tmp_path)
    chat = load_chat_template(ckpt)
    messages = _conversation(2, 3)
    ((ids, learned),) = encode_records([{"messages": messages}], tokenizer, 3, chat)
    assert tokenizer.decode(ids) == "".join(
        f"{m['role']}\n\n{m['content']}" for m in messages
    )  # the specials are dropped in decoding
    assert ids[0] == 0 and list(ids).count(3) == len(messages)  # BOS, and one <|eot_id|> a turn
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(learned.astype(int))) + 1)
    taught = [r for r in runs if learned[r[0]]]
    assert [tokenizer.decode(ids[r]) for r in taught] == ["5", "10"]
    assert all(ids[r[-1]] == 3 for r in taught)  # each ends with its <|eot_id|>


def test_chat_records_without_a_template_or_with_bad_messages_are_one_line(tmp_path, capfd):
    ckpt, data, _ = write_chat(tmp_path)
    (ckpt / "tokenizer_config.json").unlink()
    base = ["train", "--init", str(ckpt), "--seq", "48", "--steps", "1"]
    assert main([*base, "--data", str(data)]) == 2
    err = capfd.readouterr().err
    assert "rendered with the checkpoint's chat template: --init a checkpoint whose" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    assert main([*base, "--data", str(bad)]) == 2
    err = capfd.readouterr().err
    assert f"{bad}:1: message 0 must be" in err and err.count("\n") == 1, err


@pytest.mark.slow  # a training run
def test_zpp_train_fine_tunes_on_conversations(tmp_path, capfd):
    """zpp train --init DIR --data chat.jsonl trains (the loss falls) and
    its first step's loss is the checkpoint's own on the assistant tokens;
    `zpp sample --chat` writes the reply the exported model writes after
    the template's assistant header, up to its end of turn."""
    ckpt, data, tokenizer = write_chat(tmp_path)
    metrics, run = tmp_path / "m.jsonl", str(tmp_path / "run")
    args = ["train", "--init", str(ckpt), "--data", str(data), "--quiet", "--seq", "48"]
    args += ["--ckpt-dir", run]
    args += ["--batch", "8", "--steps", "6", "--eval-every", "0", "--lr", "1e-2", "--warmup", "1"]
    args += ["--zero3", "--comm-dtype", "float32", "--compute-dtype", "float32"]
    assert main([*args, "--metrics", str(metrics)]) == 0
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    cfg = RunConfig(init=str(ckpt), data=str(data), seq_len=48, batch=8)
    batch = run_corpus.load(cfg).dataset(48, 304).batch("train", 0, 8, seed=0)
    model = hf.load(ckpt, seq_len=48)
    want = cross_entropy(model(jnp.asarray(batch["inputs"])), batch["targets"], batch["weights"])
    assert losses[0] == pytest.approx(float(want), rel=1e-5)
    assert losses[-1] < losses[0]
    out = tmp_path / "exported"
    assert main(["export", "--ckpt-dir", run, "--hf", str(out), "--dtype", "float32"]) == 0
    capfd.readouterr()
    prompt = "add two and three"
    assert (
        main(["sample", "--ckpt-dir", run, "--prompt", prompt, "--chat", "--max-tokens", "6"]) == 0
    )
    rendered = load_chat_template(ckpt).render(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    ids = generate(hf.load(out), tokenizer.encode_text(rendered), 6, eos_id=3)
    assert capfd.readouterr().out == tokenizer.decode(ids) + "\n"


def test_a_huge_record_is_tokenized_only_as_far_as_a_row_reaches(tmp_path):
    """A record of a million characters, encoded for rows of 17 tokens:
    its first 17 tokens are those of the whole text, and what is tokenized
    is bounded by the tokenizer's longest token per token, not the text."""
    _, _, tokenizer = write_chat(tmp_path)
    text = "add two and three 5 " * 50_000
    record = {"prompt": "add", "completion": text}
    ((whole, _),) = encode_records([record], tokenizer, 3)
    ((cut, learned),) = encode_records([record], tokenizer, 3, max_tokens=17)
    np.testing.assert_array_equal(cut[:17], whole[:17])
    longest = int(np.max(tokenizer.token_bytes))
    assert 17 <= len(cut) <= 18 * longest + 2 and len(whole) > 100_000
    assert learned[len(tokenizer.encode_text("add", special=True)) :].all()
