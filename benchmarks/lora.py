"""LoRA over a quantized frozen base against LoRA over the fp32 base: the
same fine-tuning run (`zpp train --init CKPT --lora RANK`) with the base
kept as fp32 weights, as int8 codes and as int4 codes, side by side.

The checkpoint is a small Llama pretrained here on sentences such as "three
plus five is 8." and exported with `zpp export`; the task is JSONL examples
of the same sums in another form ("add three and five:" -> " 8"), the loss
on the completion only. Every run sees the same batches. Writes the
curves, final losses and state bytes per device as JSON, and the curves as
a PNG.

    JAX_NUM_CPU_DEVICES=8 python benchmarks/lora.py --out docs/results/DATE-lora
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# name: (bits of the base's codes, None for fp32 weights; the run's seed).
# The second fp32 run (another seed: another adapter init and batch order)
# shows how far two runs of the same method land apart.
RUNS = {"fp32": (None, 0), "int8": (8, 0), "int4": (4, 0), "fp32, seed 1": (None, 1)}


def write_task(directory: pathlib.Path, examples: int = 600) -> tuple[pathlib.Path, pathlib.Path]:
    """A pretrained checkpoint and the fine-tuning examples.

    The base is a small Llama trained from scratch (every weight, ZeRO++)
    on sentences such as "three plus five is 8.", then exported as a
    Hugging Face checkpoint with its BPE tokenizer; the examples ask the
    same sums in another form ("add three and five:" -> " 8")."""
    import numpy as np

    from zpp_jax.data.tokenizer import train_bpe
    from zpp_jax.recipes import RunConfig
    from zpp_jax.recipes.export import export_hf
    from zpp_jax.recipes.train import run

    rng = np.random.default_rng(0)
    pairs = rng.integers(0, 10, (examples, 2))
    records = [
        {"prompt": f"add {WORDS[a]} and {WORDS[b]}:", "completion": f" {a + b}"} for a, b in pairs
    ]
    sums = rng.integers(0, 10, (8000, 2))
    sentences = [f"{WORDS[a]} plus {WORDS[b]} is {a + b}." for a, b in sums]
    corpus = directory / "sums.txt"
    corpus.write_text(" ".join(sentences))
    text = corpus.read_bytes() + b" ".join(
        (r["prompt"] + r["completion"]).encode() for r in records
    )
    train_bpe(text, 320).save(directory / "tokenizer.json")
    pretrain = RunConfig(
        arch="llama",
        data=str(corpus),
        tokenizer=str(directory / "tokenizer.json"),
        seq_len=32,
        batch=16,
        steps=600,
        lr=3e-3,
        eval_every=0,
        compute_dtype="float32",
        ckpt_dir=str(directory / "pretrain"),
        progress=False,
    )
    run(pretrain)
    export_hf(directory / "pretrain", directory / "ckpt", dtype="float32")
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory / "ckpt", data


def run_base(ckpt, data, bits, seed: int, steps: int, rank: int, lr: float) -> dict:
    """One LoRA run over the base stored with `bits` (None: fp32)."""
    from zpp_jax.config import ZeroPPConfig
    from zpp_jax.recipes import RunConfig
    from zpp_jax.recipes.train import run

    zero = ZeroPPConfig(comm_dtype="bfloat16", frozen_bits=bits)
    cfg = RunConfig(
        zero=zero,
        init=str(ckpt),
        data=str(data),
        lora=rank,
        seq_len=24,
        batch=16,
        steps=steps,
        lr=lr,
        warmup=10,
        eval_every=25,
        compute_dtype="float32",
        seed=seed,
        progress=False,
    )
    records = run(cfg)
    return {
        "loss": [r["loss"] for r in records],
        "val": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
        "state_bytes_per_device": records[0]["state_bytes_per_device"],
    }


def state_per_device(rank: int = 16, nodes: int = 2, local: int = 4) -> dict:
    """Bytes of the training state one device holds for Llama 2 7B's
    shapes with LoRA adapters of `rank` on every linear layer (Adam), per
    base: fp32 or bf16 weights, int8 or int4 codes. Abstract: nothing is
    allocated or compiled."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from zpp_jax.analysis.report import state_bytes_per_device
    from zpp_jax.config import ZeroPPConfig
    from zpp_jax.lora import FROZEN, add_lora
    from zpp_jax.mesh import make_mesh
    from zpp_jax.models import Llama, LlamaConfig
    from zpp_jax.train import Trainer

    def make(dtype):
        model = add_lora(Llama(LlamaConfig.preset("7b"), nnx.Rngs(0)), rank)
        for _, var in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam))):
            var.set_value(var.get_value().astype(dtype))
        return model

    mesh = make_mesh(nodes, local)
    out = {}
    for name, (dtype, bits) in {
        "fp32": (jnp.float32, None),
        "bf16": (jnp.bfloat16, None),
        "int8": (jnp.float32, 8),
        "int4": (jnp.float32, 4),
    }.items():
        config = ZeroPPConfig(comm_dtype="bfloat16", frozen_bits=bits)
        model = nnx.eval_shape(lambda dtype=dtype: make(dtype))
        trainer = Trainer(model, optax.adamw(1e-4), mesh, config, freeze=FROZEN)
        out[name] = state_bytes_per_device(trainer.abstract_state())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if (args.out / "lora.json").exists() and not args.overwrite:
        sys.exit(f"{args.out}/lora.json exists: pass --overwrite to replace it")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    work = pathlib.Path(tempfile.mkdtemp(prefix="lora-"))
    ckpt, data = write_task(work)
    runs = {
        name: run_base(ckpt, data, bits, seed, args.steps, args.rank, args.lr)
        for name, (bits, seed) in RUNS.items()
    }
    summary = _summary(runs)
    memory = state_per_device()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "steps": args.steps,
        "rank": args.rank,
        "lr": args.lr,
        "summary": summary,
        "llama7b_lora16_state_bytes_per_device_2x4": memory,
        "runs": runs,
    }
    (args.out / "lora.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(runs, args.out / "lora.png")
    (args.out / "report.md").write_text(_page(result))
    for name, size in memory.items():
        print(f"Llama 7B, LoRA rank 16, {name} base: {size / 2**30:.3f} GiB of state per device")
    for name, row in summary.items():
        print(
            f"{name}: final val loss {row['val_loss']:.4f} ({row['vs_fp32']:+.2%} vs fp32), "
            f"last-10 train loss {row['train_loss']:.4f}, state {row['state_bytes']:,} B/device"
        )


def _summary(runs: dict) -> dict:
    out = {}
    for name, r in runs.items():
        out[name] = {
            "val_loss": r["val"][-1][1],
            "train_loss": sum(r["loss"][-10:]) / len(r["loss"][-10:]),
            "state_bytes": r["state_bytes_per_device"],
        }
    for row in out.values():
        row["vs_fp32"] = row["val_loss"] / out["fp32"]["val_loss"] - 1
        row["state_vs_fp32"] = row["state_bytes"] / out["fp32"]["state_bytes"]
    return out


def _page(result: dict) -> str:
    rows = ["| base | final validation loss | vs fp32 base | last-10 train loss | state B/device |"]
    rows.append("|---|---|---|---|---|")
    for name, r in result["summary"].items():
        rows.append(
            f"| {name} | {r['val_loss']:.4f} | {r['vs_fp32']:+.2%} | {r['train_loss']:.4f} | "
            f"{r['state_bytes']:,} |"
        )
    memory = result["llama7b_lora16_state_bytes_per_device_2x4"]
    mem_rows = ["| base | GiB per device | vs bf16 base | vs fp32 base |", "|---|---|---|---|"]
    for name, size in memory.items():
        mem_rows.append(
            f"| {name} | {size / 2**30:.3f} | {size / memory['bf16']:.3f}x | "
            f"{size / memory['fp32']:.3f}x |"
        )
    return (
        "# LoRA over a quantized frozen base\n\n"
        "Made by `JAX_NUM_CPU_DEVICES=8 python benchmarks/lora.py --out DIR "
        f"--steps {result['steps']}` on a 2-core CPU machine (8 emulated devices, mesh 2 x 4). "
        'A small Llama (the `tiny` preset) is pretrained here on sentences such as "three plus '
        'five is 8." and exported as a Hugging Face checkpoint; then `zpp train --init '
        f"--lora {result['rank']}` (lr {result['lr']}, batch 16, 24 tokens, ZeRO++ with a "
        'bf16 wire) fine-tunes it on "add three and five:" -> " 8", the loss on the '
        "completion only, with the base kept as fp32 weights, int8 codes or int4 codes. "
        "Every run sees the same batches. Data: [lora.json](lora.json).\n\n"
        + "\n".join(rows)
        + "\n\n![curves](lora.png)\n\n"
        "Training state per device (model, adapters, Adam's moments) for Llama 2 7B's shapes "
        "with rank-16 adapters on every linear layer, on a 2 x 4 mesh, from the abstract "
        "state (nothing allocated):\n\n" + "\n".join(mem_rows) + "\n"
    )


def _plot(runs: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in runs.items():
        line = ax.plot(range(1, len(r["loss"]) + 1), r["loss"], lw=0.8, alpha=0.6, label=name)
        steps, val = zip(*r["val"], strict=True)
        ax.plot(steps, val, "o-", color=line[0].get_color(), label=f"{name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss on completions (nats per token)")
    ax.set_yscale("log")
    ax.set_title("LoRA over the frozen base: fp32 weights, int8 and int4 codes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
