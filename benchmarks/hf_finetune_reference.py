"""A fine-tuning round trip through transformers: a tied, llama3-rope Llama
and its tokenizer (with a chat template) saved by transformers'
``save_pretrained``, fine-tuned by ``zpp train --lora 8`` over an int8
base on conversations, exported by ``zpp export`` and loaded back by
transformers.

It checks what a user of the export relies on:

1. the context: ``max_position_embeddings`` and the rope scaling kept;
2. the tokenizer files, the chat template and the generation defaults
   present, and transformers' tokenizer's ``eos_token`` set;
3. every tensor no adapter wraps (the embedding, the norms) bit for bit
   the base's;
4. the chat template's rendering, ours against ``apply_chat_template``;
5. greedy tokens: ``zpp sample --chat`` against transformers' ``generate``
   on the exported model, from the same rendered prompt;
6. logits, for each frozen base (int8, int4, unquantized): the trained
   model's in zpp against transformers' on its export with
   ``--merge-onto codes`` (exactly what was trained), over a sequence four
   times the training length; and how far the default export (merged onto
   the base's own kernels) moves them.

torch and transformers run in another Python (``--torch-python``, a
virtual environment with both; they are not dependencies of zpp-jax).
Writes ``hf_finetune.json`` and ``report.md`` in ``--out``.

    python benchmarks/hf_finetune_reference.py --torch-python /path/to/venv/bin/python \\
        --out docs/results/DATE-hf-finetune
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pages

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3 Instruct's chat template.
TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PROMPTS = ["add two and three", "add nine and nine", "add zero and four"]
FROZEN = ["8", "4", "none"]  # --frozen-bits; the round trip's checks use the first
LOGIT_TOKENS = 128  # four times the training --seq: the base's whole context

# Runs in the torch Python: `save` writes the base, `check` reads the export.
TORCH_SIDE = r"""
import json, sys, pathlib
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers import PreTrainedTokenizerFast
from tokenizers import Tokenizer
mode, root = sys.argv[1], pathlib.Path(sys.argv[2])
spec = json.loads((root / "spec.json").read_text())
if mode == "save":
    torch.manual_seed(0)
    cfg = LlamaConfig(**spec["config"])
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from their initial ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = spec["eos_ids"]
    model.save_pretrained(root / "base")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(root / "bpe.json")),
        bos_token=spec["specials"][0], eos_token=spec["specials"][3],
    )
    tok.chat_template = spec["template"]
    tok.save_pretrained(root / "base")
    print(json.dumps({"transformers": __import__("transformers").__version__,
                      "torch": torch.__version__}))
elif mode == "logits":
    import numpy as np
    ids = torch.tensor(np.load(root / "ids.npy"))[None]
    found = {}
    for name in spec["logit_exports"]:
        model = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32)
        with torch.no_grad():
            found[name] = model(ids).logits[0].numpy()
    np.savez(root / "torch_logits.npz", **found)
    print(json.dumps({"written": sorted(found)}))
else:
    out = root / "exported"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    mine, theirs = dict(model.named_parameters()), dict(base.named_parameters())
    untouched = [n for n in theirs if "_proj" not in n]
    exact = {n: bool(torch.equal(mine[n], theirs[n])) for n in untouched}
    rendered, tokens = {}, {}
    for prompt in spec["prompts"]:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        rendered[prompt] = text
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=spec["max_tokens"], do_sample=False,
                             eos_token_id=spec["eos_ids"], pad_token_id=spec["eos_ids"][0])
        tokens[prompt] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    print(json.dumps({
        "max_position_embeddings": model.config.max_position_embeddings,
        "rope_scaling": model.config.rope_parameters,
        "eos_token": tok.eos_token,
        "files": sorted(p.name for p in out.iterdir()),
        "exact": exact, "rendered": rendered, "replies": tokens,
    }))
"""


def _torch(python: str, mode: str, root: pathlib.Path) -> dict:
    run = subprocess.run(
        [python, "-c", TORCH_SIDE, mode, str(root)], capture_output=True, text=True, check=False
    )
    if run.returncode:
        sys.exit(f"the torch side ({mode}) failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _zpp(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "zpp_jax", *args], capture_output=True, text=True, check=False
    )
    if run.returncode:
        sys.exit(f"zpp {args[0]} failed:\n{run.stderr[-3000:]}")
    return run.stdout


def _conversations() -> list:
    out = []
    for i in range(64):
        a, b = i % 10, (3 * i) % 10
        out.append(
            [
                {"role": "user", "content": f"add {WORDS[a]} and {WORDS[b]}"},
                {"role": "assistant", "content": f"{a + b}"},
            ]
        )
    return out


def _write_inputs(root: pathlib.Path) -> dict:
    from zpp_jax.data.tokenizer import train_bpe

    conversations = _conversations()
    text = " ".join(m["content"] for c in conversations for m in c).encode() * 8
    train_bpe(text, 300, special_tokens=SPECIALS).save(root / "bpe.json")
    (root / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in conversations)
    )
    spec = {
        "config": {
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "bos_token_id": 0,
            "eos_token_id": 3,
        },
        "specials": SPECIALS,
        "eos_ids": [3],
        "template": TEMPLATE,
        "prompts": PROMPTS,
        "max_tokens": 8,
        "logit_exports": [f"{bits}_{onto}" for bits in FROZEN for onto in ("codes", "base")],
    }
    (root / "spec.json").write_text(json.dumps(spec))
    return spec


def _train_and_export(root: pathlib.Path, bits: str) -> str:
    """`zpp train --lora 8 --frozen-bits BITS` on the conversations, exported
    merged onto the base (``BITS_base``) and onto the codes
    (``BITS_codes``); the run's directory."""
    run = str(root / f"run_{bits}")
    train = ["train", "--init", str(root / "base"), "--data", str(root / "chat.jsonl")]
    train += ["--lora", "8", "--frozen-bits", bits, "--seq", "32", "--batch", "8"]
    train += ["--steps", "150", "--lr", "1e-2", "--ckpt-dir", run, "--quiet", "--eval-every", "0"]
    _zpp(*train)
    for onto in ("base", "codes"):
        out = str(root / f"{bits}_{onto}")
        _zpp("export", "--ckpt-dir", run, "--hf", out, "--dtype", "float32", "--merge-onto", onto)
    return run


def _zpp_logits(run: str, ids) -> object:
    """The trained model's logits over `ids`, in this process, computed in
    float32 (the run computed in bfloat16; transformers reads the export
    in float32)."""
    import jax.numpy as jnp
    from flax import nnx

    from zpp_jax.recipes.export import restore_run_model
    from zpp_jax.sharded import unshard

    model, _, _ = restore_run_model(run, seq_len=len(ids))
    model = unshard(model)
    for _, module in model.iter_modules():
        if isinstance(getattr(module, "dtype", None), (str, type(jnp.float32))):
            module.dtype = "float32"
    assert all(
        getattr(m, "dtype", "float32") in ("float32", jnp.float32) for _, m in model.iter_modules()
    ), "a module still computes in another dtype"
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ids)[None])[0], np.float32)


def _kernel_changes(root: pathlib.Path, bits: str) -> dict:
    """Over the adapted kernels, medians of ‖decoded codes - base‖ / ‖base‖
    (the frozen base's quantization error) and ‖scale·B·A‖ / ‖base‖ (what
    training added), read from the two exports and the base."""
    from safetensors.numpy import load_file

    base = load_file(root / "base" / "model.safetensors")
    codes = load_file(root / f"{bits}_codes" / "model.safetensors")
    onto_base = load_file(root / f"{bits}_base" / "model.safetensors")
    quant, update = [], []
    for name in (n for n in base if "_proj" in n):
        norm = np.linalg.norm(base[name])
        quant.append(np.linalg.norm(codes[name] - onto_base[name]) / norm)
        update.append(np.linalg.norm(onto_base[name] - base[name]) / norm)
    return {"quantization_error": float(np.median(quant)), "update": float(np.median(update))}


def _log_probs(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _logit_rows(python: str, root: pathlib.Path, runs: dict) -> list:
    """Per frozen base: zpp's logits against transformers' on each export."""
    ids = np.random.default_rng(0).integers(4, 320, LOGIT_TOKENS).astype(np.int64)
    np.save(root / "ids.npy", ids)
    _torch(python, "logits", root)
    theirs = np.load(root / "torch_logits.npz")
    rows = []
    for bits, run in runs.items():
        ours = _zpp_logits(run, ids)
        changes = _kernel_changes(root, bits)
        scale = float(np.abs(ours).max())
        for onto in ("codes", "base"):
            diff = np.abs(theirs[f"{bits}_{onto}"] - ours)
            prob_diff = np.abs(_log_probs(theirs[f"{bits}_{onto}"]) - _log_probs(ours))
            rows.append(
                {
                    "frozen_bits": bits,
                    "merge_onto": onto,
                    "tokens": LOGIT_TOKENS,
                    "max_abs_logit": scale,
                    "max_abs_diff": float(diff.max()),
                    "max_rel_diff": float(diff.max() / scale),
                    "max_log_prob_diff": float(prob_diff.max()),
                    "kernels": changes,
                    "argmax_equal": float(
                        np.mean(theirs[f"{bits}_{onto}"].argmax(-1) == ours.argmax(-1))
                    ),
                }
            )
    return rows


def run_round_trip(python: str, root: pathlib.Path) -> dict:
    """Every check's result (see the module's docstring)."""
    from zpp_jax.data.chat import load_chat_template

    spec = _write_inputs(root)
    versions = _torch(python, "save", root)
    runs = {bits: _train_and_export(root, bits) for bits in FROZEN}
    run = runs[FROZEN[0]]
    shutil.copytree(root / f"{FROZEN[0]}_base", root / "exported")
    theirs = _torch(python, "check", root)
    ours = load_chat_template(root / "exported")
    replies = {}
    for prompt in PROMPTS:
        text = _zpp("sample", "--ckpt-dir", run, "--prompt", prompt, "--chat", "--max-tokens", "8")
        replies[prompt] = text.rstrip("\n")
    rendered = {
        p: ours.render([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    }
    base = json.loads((root / "base" / "config.json").read_text())
    return {
        "versions": versions,
        "context_kept": theirs["max_position_embeddings"] == 128,
        "rope_scaling": theirs["rope_scaling"],
        "eos_token": theirs["eos_token"],
        "files": theirs["files"],
        "untouched_exact": theirs["exact"],
        "template_equal": {p: rendered[p] == theirs["rendered"][p] for p in PROMPTS},
        "replies": {p: {"zpp": replies[p], "transformers": theirs["replies"][p]} for p in PROMPTS},
        "logits": _logit_rows(python, root, runs),
        "base_config": base,
        "spec": spec,
    }


def _page(report: dict, made: dict) -> str:
    exact, versions = report["untouched_exact"], report["versions"]
    rows = [
        ["context (max_position_embeddings 128) kept", str(report["context_kept"])],
        ["rope scaling read back", f"`{json.dumps(report['rope_scaling'])}`"],
        ["transformers' eos_token", f"`{report['eos_token']}`"],
        ["files of the export", ", ".join(report["files"])],
        ["tensors without an adapter bit for bit", f"{sum(exact.values())} of {len(exact)}"],
        [
            "chat template renders as apply_chat_template",
            str(all(report["template_equal"].values())),
        ],
    ]
    replies = [
        [f"`{p}`", f"`{r['zpp']}`", f"`{r['transformers']}`", str(r["zpp"] == r["transformers"])]
        for p, r in report["replies"].items()
    ]
    logits = [
        [
            r["frozen_bits"],
            r["merge_onto"],
            f"{r['max_abs_logit']:.2f}",
            f"{r['max_abs_diff']:.2e}",
            f"{r['max_rel_diff']:.1e}",
            f"{r['max_log_prob_diff']:.2e}",
            f"{r['argmax_equal']:.3f}",
            f"{r['kernels']['quantization_error']:.1e}",
            f"{r['kernels']['update']:.2f}",
        ]
        for r in report["logits"]
    ]
    return (
        "# A LoRA fine-tune round trip through transformers\n\n"
        f"Made by `{made['command']}`. {pages.machine_line(made['machine'])} "
        f"transformers {versions['transformers']}, torch {versions['torch']}.\n\n"
        "A tied-embedding Llama with llama3 rope scaling (128 positions) and its BPE "
        "tokenizer with Llama 3 Instruct's chat template, saved by transformers; "
        "`zpp train --lora 8` over the int8 base on 64 conversations (150 steps, 32 tokens), "
        "and the same over an int4 and an unquantized base for the logits below; "
        "`zpp export --dtype float32` (the adapters merged onto the base's own kernels, the "
        "default); loaded back by transformers. Data: "
        "[hf_finetune.json](hf_finetune.json).\n\n"
        + pages.table(["check", "result"], rows)
        + "\n\nGreedy replies, `zpp sample --chat` against transformers' `generate` on the "
        "export (special tokens dropped):\n\n"
        + pages.table(["prompt", "zpp sample --chat", "transformers", "equal"], replies)
        + "\n\nLogits over "
        f"{LOGIT_TOKENS} random tokens (the base's whole context, four times the training "
        "length), for a run over each frozen base (`--frozen-bits`): the trained model in "
        "zpp (the run's checkpoint, unsharded) against transformers on its export. "
        "Both in float32 (the run computed in bfloat16). `codes`: `zpp export --merge-onto "
        "codes`, the adapters merged onto the codes the run computed with, which is the "
        "trained model, so the difference is float32 round-off; `base`: the default "
        "export, merged onto the base's own kernels, so "
        "the difference is what the frozen base's quantization changed (zero for `none`). "
        "Argmax equal: the fraction of positions whose greedy token agrees. The last two "
        "columns are medians over the adapted kernels, relative to the base kernel's norm: "
        "the decoded codes' distance from it, and the merged update scale·B·A (this small "
        "model's adapters outgrow their kernels at this learning rate).\n\n"
        + pages.table(
            [
                "frozen bits",
                "merged onto",
                "largest logit",
                "max abs diff",
                "relative",
                "max log-prob diff",
                "argmax equal",
                "kernels' quantization error",
                "adapters' update",
            ],
            logits,
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-python", required=True, help="a Python with torch, transformers")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    pages.prepare(args.out, "hf_finetune", args.overwrite)
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    with tempfile.TemporaryDirectory() as tmp:
        report = run_round_trip(args.torch_python, pathlib.Path(tmp))
    made = {"command": pages.command(), "machine": pages.machine()}
    pages.write_json(args.out, "hf_finetune", {**made, **report})
    pages.write_page(args.out, _page(report, made))


if __name__ == "__main__":
    main()
