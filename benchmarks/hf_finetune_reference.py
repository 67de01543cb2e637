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
   on the exported model, from the same rendered prompt.

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
import subprocess
import sys
import tempfile

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
    }
    (root / "spec.json").write_text(json.dumps(spec))
    return spec


def run_round_trip(python: str, root: pathlib.Path) -> dict:
    """Every check's result (see the module's docstring)."""
    from zpp_jax.data.chat import load_chat_template

    spec = _write_inputs(root)
    versions = _torch(python, "save", root)
    run = str(root / "run")
    train = ["train", "--init", str(root / "base"), "--data", str(root / "chat.jsonl")]
    train += ["--lora", "8", "--seq", "32", "--batch", "8", "--steps", "150", "--lr", "1e-2"]
    train += ["--ckpt-dir", run, "--quiet", "--eval-every", "0"]
    _zpp(*train)
    _zpp("export", "--ckpt-dir", run, "--hf", str(root / "exported"), "--dtype", "float32")
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
    return (
        "# A LoRA fine-tune round trip through transformers\n\n"
        f"Made by `{made['command']}`. {pages.machine_line(made['machine'])} "
        f"transformers {versions['transformers']}, torch {versions['torch']}.\n\n"
        "A tied-embedding Llama with llama3 rope scaling (128 positions) and its BPE "
        "tokenizer with Llama 3 Instruct's chat template, saved by transformers; "
        "`zpp train --lora 8` over the int8 base on 64 conversations (150 steps, 32 tokens); "
        "`zpp export --dtype float32` (the adapters merged onto the base's own kernels, the "
        "default); loaded back by transformers. Data: "
        "[hf_finetune.json](hf_finetune.json).\n\n"
        + pages.table(["check", "result"], rows)
        + "\n\nGreedy replies, `zpp sample --chat` against transformers' `generate` on the "
        "export (special tokens dropped):\n\n"
        + pages.table(["prompt", "zpp sample --chat", "transformers", "equal"], replies)
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
