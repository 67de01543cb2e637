"""ZeRO-3, ZeRO++ and plain `jax.jit` compiled for 2 x 4 H200 GPUs: the
bytes each GPU sends across nodes per step, and XLA's estimate of the step
and of the communication its schedule leaves exposed.

Nothing runs on a GPU: each step is compiled for XLA's H200 target
description (`zpp comm --target h200`, which needs the gpu-aot extra and
``ZPP_GPU_TARGET_CONFIG``), and the times are the scheduler's cost model,
not measurements. Writes the reports as JSON, a PNG and a results page.

    python benchmarks/gpu_schedule.py --out docs/results/DATE-h200-schedule
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

MODELS = {  # name: zpp comm flags
    "GPT 125m": ["--arch", "gpt", "--model", "125m", "--seq", "1024", "--batch", "8"],
    "Llama 7B": ["--arch", "llama", "--model", "7b", "--seq", "2048", "--batch", "8"],
}
CONFIGS = ("zero3", "zeropp", "jit")
LABELS = {"zero3": "ZeRO-3 (bf16 wire)", "zeropp": "ZeRO++", "jit": "plain jax.jit (FSDP)"}


def compile_reports(flags: list[str]) -> dict:
    """`zpp comm --target h200 --json` for one model: report per config."""
    command = [sys.executable, "-m", "zpp_jax", "comm", "--target", "h200", "--json"]
    command += [*flags, "--compute-dtype", "bfloat16", "--configs", *CONFIGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if run.returncode:
        sys.exit(f"zpp comm failed:\n{run.stderr[-3000:]}")
    return {r["name"]: r for r in json.loads(run.stdout)["configs"]}


def summary(reports: dict) -> dict:
    """Per model and config: cross-node bytes per GPU, XLA's step and
    exposed-communication estimates (ms; None where it gives none)."""
    out = {}
    for model, by_config in reports.items():
        out[model] = {}
        for config, r in by_config.items():
            est = r["estimate"]
            out[model][config] = {
                "cross_node_bytes": r["cross_node_bytes"],
                "step_ms": None if est is None else est["step_us"] / 1e3,
                "exposed_ms": None if est is None else sum(est["exposed_us"].values()) / 1e3,
                "estimate_withheld": r["estimate_withheld"],
            }
    return out


def plot(rows: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.27
    for i, config in enumerate(CONFIGS):
        x = np.arange(len(models)) + (i - 1) * width
        sent = [rows[m][config]["cross_node_bytes"] / 1e9 for m in models]
        left.bar(x, sent, width, label=LABELS[config])
        step = [rows[m][config]["step_ms"] or 0 for m in models]
        exposed = [rows[m][config]["exposed_ms"] or 0 for m in models]
        bars = right.bar(x, step, width, label=LABELS[config])
        right.bar(x, exposed, width, color="none", edgecolor="black", hatch="//", lw=0.5)
        for bar, value in zip(bars, step, strict=True):
            if not value:
                right.text(bar.get_x() + width / 2, 0, "none", ha="center", va="bottom", fontsize=7)
    for ax in (left, right):
        ax.set_xticks(np.arange(len(models)), models)
        ax.grid(axis="y", alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("GB sent across nodes per GPU per step")
    right.set_ylabel("XLA's estimated step, ms")
    right.set_title("hatched: communication no compute covers", fontsize=9)
    left.legend(fontsize=8)
    fig.suptitle("2 nodes x 4 H200, compiled (not run): XLA's estimates", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def page(rows: dict) -> str:
    lines = [
        "| model | method | GB across nodes per GPU | XLA's step estimate, ms | exposed, ms |",
        "|---|---|---|---|---|",
    ]
    for model, by_config in rows.items():
        for config, r in by_config.items():
            step = "none" if r["step_ms"] is None else f"{r['step_ms']:.1f}"
            exposed = "none" if r["exposed_ms"] is None else f"{r['exposed_ms']:.1f}"
            gb = r["cross_node_bytes"] / 1e9
            lines.append(f"| {model} | {LABELS[config]} | {gb:.3f} | {step} | {exposed} |")
    return (
        "# ZeRO-3, ZeRO++ and jit compiled for H200s: XLA's estimates\n\n"
        "Made by `python benchmarks/gpu_schedule.py --out DIR` on a 2-core CPU machine "
        "with the gpu-aot extra: each training step (AdamW, bf16 compute) is compiled for "
        "2 nodes x 4 H200 GPUs from XLA's H200 target description; nothing ran on a GPU. "
        "The step and exposed-communication times are **XLA's estimates** (its scheduler's "
        'cost model, with the engine\'s link model), not measurements; "none" where XLA '
        "gives no estimate (a program with a loop). GPT 125m: batch 8 x 1024 tokens; "
        "Llama 7B: batch 8 x 2048. Data: [gpu_schedule.json](gpu_schedule.json).\n\n"
        + "\n".join(lines)
        + "\n\n![bytes and steps](gpu_schedule.png)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if (args.out / "gpu_schedule.json").exists() and not args.overwrite:
        sys.exit(f"{args.out}/gpu_schedule.json exists: pass --overwrite to replace it")
    reports = {model: compile_reports(flags) for model, flags in MODELS.items()}
    rows = summary(reports)
    args.out.mkdir(parents=True, exist_ok=True)
    # Each report without its per-collective list (`zpp comm --json` has it).
    kept = {
        model: {c: {k: v for k, v in r.items() if k != "collectives"} for c, r in by.items()}
        for model, by in reports.items()
    }
    (args.out / "gpu_schedule.json").write_text(
        json.dumps({"summary": rows, "reports": kept}, indent=2) + "\n"
    )
    plot(rows, args.out / "gpu_schedule.png")
    (args.out / "report.md").write_text(page(rows))
    print(page(rows))


if __name__ == "__main__":
    main()
