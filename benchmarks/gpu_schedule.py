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

import pages

GPT = ["--arch", "gpt", "--model", "125m", "--seq", "1024"]
LLAMA = ["--arch", "llama", "--model", "7b", "--seq", "2048"]
MODELS = {  # name: zpp comm flags; one sequence per GPU of 2 x 4
    "GPT 125m": [*GPT, "--batch", "8"],
    "Llama 7B": [*LLAMA, "--batch", "8"],
}
# Depths and meshes the engine was not tuned on, with the 2 x 4 models above:
# ZeRO-3 and ZeRO++ only. name: zpp comm flags.
SPREAD = {
    "GPT 125m, 12 layers": [*GPT, "--batch", "8", "--layers", "12"],
    "GPT 125m, 24 layers": [*GPT, "--batch", "8", "--layers", "24"],
    "Llama 7B on 2 x 8": [*LLAMA, "--batch", "16", "--nodes", "2", "--local", "8"],
    "Llama 7B on 4 x 8": [*LLAMA, "--batch", "32", "--nodes", "4", "--local", "8"],
}
SPREAD_CONFIGS = ("zero3", "zeropp")
CONFIGS = ("zero3", "zeropp", "jit", "jit_fsdp")  # the picture's
COMPILED = (*CONFIGS, "zeropp_ef")  # the tables'
LABELS = {
    "zero3": "ZeRO-3 (bf16 wire)",
    "zeropp": "ZeRO++",
    "jit": "jax.jit, XLA-partitioned",
    "jit_fsdp": "jax.jit, FSDP constraints",
    "zeropp_ef": "ZeRO++, error feedback",
}


def compile_reports(flags: list[str], configs=COMPILED) -> dict:
    """`zpp comm --target h200 --json` for one model: report per config."""
    command = [sys.executable, "-m", "zpp_jax", "comm", "--target", "h200", "--json"]
    command += [*flags, "--compute-dtype", "bfloat16", "--configs", *configs]
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
    import numpy as np

    models = list(rows)
    fig, (left, right) = pages.figure(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        x = np.arange(len(models)) + (i - (len(CONFIGS) - 1) / 2) * width
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
    pages.save(fig, path, titled=True)


def _share(done: int, total: int) -> str:
    return f"{done}/{total} ({done / total:.0%})" if total else "none"


def details(reports: dict) -> str:
    """Per model and config: memory, what runs behind a GEMM, bytes and
    XLA's estimates."""
    header = ["model", "method", "peak GB per GPU", "state GB per GPU"]
    header += ["weight gathers behind a GEMM", "other collectives behind a GEMM"]
    header += ["cross-node MB per GPU", "intra-node MB per GPU"]
    header += ["XLA's step estimate, ms", "exposed (estimate), ms: gathers + others"]
    rows = []
    for model, by in reports.items():
        for config in COMPILED:
            r = by[config]
            gathers = r["overlap"].get("all-gather", [0, 0])
            others = [r["overlap"][k] for k in r["overlap"] if k != "all-gather"]
            others = [sum(x[0] for x in others), sum(x[1] for x in others)]
            est = r["estimate"]
            if est is None:
                step = exposed = "none"
            else:
                gathered = est["exposed_us"].get("all-gather", 0) / 1e3
                rest = sum(est["exposed_us"].values()) / 1e3 - gathered
                step, exposed = f"{est['step_us'] / 1e3:.1f}", f"{gathered:.1f} + {rest:.1f}"
            rows.append(
                [
                    model,
                    LABELS[config],
                    f"{r['peak_memory_bytes'] / 1e9:.2f}",
                    f"{r['state_bytes'] / 1e9:.2f}",
                    _share(*gathers),
                    _share(*others),
                    f"{r['cross_node_bytes'] / 1e6:,.1f}",
                    f"{r['intra_node_bytes'] / 1e6:,.1f}",
                    step,
                    exposed,
                ]
            )
    return pages.table(header, rows)


def spread(reports: dict) -> str:
    """ZeRO-3 and ZeRO++ per model, depth and mesh: XLA's step estimate,
    the communication it leaves exposed, and peak memory."""
    header = ["model", "method", "XLA's step estimate, ms", "exposed, ms (share of the step)"]
    header += ["peak GB per GPU", "ZeRO-3's step / this step"]
    rows = []
    for model, by in reports.items():
        zero3 = by["zero3"]["estimate"]["step_us"]
        for config in SPREAD_CONFIGS:
            r, est = by[config], by[config]["estimate"]
            exposed = sum(est["exposed_us"].values())
            rows.append(
                [
                    model,
                    LABELS[config],
                    f"{est['step_us'] / 1e3:.1f}",
                    f"{exposed / 1e3:.2f} ({exposed / est['step_us']:.1%})",
                    f"{r['peak_memory_bytes'] / 1e9:.2f}",
                    f"{zero3 / est['step_us']:.2f}",
                ]
            )
    return pages.table(header, rows)


def summary_table(rows: dict) -> str:
    """Per model and method: bytes across nodes, XLA's step and exposed
    estimates, and each method's step over ZeRO++'s."""
    header = ["model", "method", "GB across nodes per GPU", "XLA's step estimate, ms"]
    header += ["exposed, ms", "step / ZeRO++'s step"]
    out = []
    for model, by_config in rows.items():
        ours = by_config["zeropp"]["step_ms"]
        for config in CONFIGS:
            r = by_config[config]
            step = "none" if r["step_ms"] is None else f"{r['step_ms']:.1f}"
            exposed = "none" if r["exposed_ms"] is None else f"{r['exposed_ms']:.1f}"
            ratio = "none" if r["step_ms"] is None or not ours else f"{r['step_ms'] / ours:.2f}"
            gb = f"{r['cross_node_bytes'] / 1e9:.3f}"
            out.append([model, LABELS[config], gb, step, exposed, ratio])
    return pages.table(header, out)


def page(rows: dict, reports: dict, spread_reports: dict, made: dict) -> str:
    return (
        "# ZeRO-3, ZeRO++ and jit compiled for H200s: XLA's estimates\n\n"
        f"Made by `{made['command']}` with the gpu-aot extra. "
        f"{pages.machine_line(made['machine'])}\n\n"
        "Each training step (AdamW, bf16 compute) is compiled for "
        "2 nodes x 4 H200 GPUs from XLA's H200 target description; nothing ran on a GPU. "
        "The step and exposed-communication times are **XLA's estimates** (its scheduler's "
        'cost model, with the engine\'s link model), not measurements; "none" where XLA '
        "gives no estimate (a program with a loop). GPT 125m: batch 8 x 1024 tokens; "
        "Llama 7B: batch 8 x 2048. Data: [gpu_schedule.json](gpu_schedule.json).\n\n"
        + summary_table(rows)
        + "\n\n![bytes and steps](gpu_schedule.png)\n\n"
        "## Each step in detail\n\n"
        '"Behind a GEMM" counts a step\'s collectives (loop trip counts applied) with at '
        "least one matrix multiply between their start and their end; the weight gathers "
        "are the all-gathers, the others are the gradient's reductions (ZeRO-3: bf16 "
        "all-to-alls; qgZ: the all-to-all inside the node and the permute across nodes) "
        "and the step's few all-reduces. Peak is `memory_analysis()`'s arguments + "
        "outputs + temporaries - aliases; state is the parameters and optimizer state "
        "per GPU. Bytes are per GPU per step under the ring model.\n\n"
        + details(reports)
        + "\n\n## Other depths and meshes\n\n"
        "ZeRO-3 and ZeRO++ on depths and meshes the engine was not tuned on, beside the "
        "two models above (2 x 4): the GPT 125m's widths at 12 and 24 layers (batch 8 x "
        "1024), and the Llama 7B on 2 nodes x 8 GPUs (batch 16 x 2048) and 4 x 8 (batch 32 x "
        "2048). The same XLA estimates, with the same link model.\n\n"
        + spread({**{m: reports[m] for m in MODELS}, **spread_reports})
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--render", action="store_true", help="only redraw the page from --out's gpu_schedule.json"
    )
    args = parser.parse_args()
    if args.render:
        data = json.loads((args.out / "gpu_schedule.json").read_text())
    else:
        pages.prepare(args.out, "gpu_schedule", args.overwrite)
        reports = {model: compile_reports(flags) for model, flags in MODELS.items()}
        spread_reports = {m: compile_reports(f, SPREAD_CONFIGS) for m, f in SPREAD.items()}
        made = {"command": pages.command(), "machine": pages.machine()}
        # Each report without its per-collective list (`zpp comm --json` has it).
        kept, spread_kept = _without_collectives(reports), _without_collectives(spread_reports)
        data = {**made, "summary": summary(reports), "reports": kept, "spread": spread_kept}
        pages.write_json(args.out, "gpu_schedule", data)
    plot(data["summary"], args.out / "gpu_schedule.png")
    made = {"command": data["command"], "machine": data["machine"]}
    pages.write_page(args.out, page(data["summary"], data["reports"], data["spread"], made))


def _without_collectives(reports: dict) -> dict:
    """Each report without its per-collective list (`zpp comm --json` has it)."""
    return {
        model: {c: {k: v for k, v in r.items() if k != "collectives"} for c, r in by.items()}
        for model, by in reports.items()
    }


if __name__ == "__main__":
    main()
