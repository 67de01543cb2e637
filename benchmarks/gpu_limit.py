"""ZeRO-3, ZeRO++ and plain `jax.jit` against the limit of no communication,
compiled for H200s: each step's XLA estimate, its exposed communication, the kernels
alone, each link's busy time, MFU, memory per GPU, and the step over the
no-communication step (`zpp_jax.baseline.NoCommunication`: the same model
and per-device batch, one device's program).

Nothing runs on a GPU: each step is compiled for XLA's H200 target
description (`zpp comm --target h200 --json`, which needs the gpu-aot
extra and ``ZPP_GPU_TARGET_CONFIG``); the times are XLA's estimates, not
measurements. Writes JSON, a PNG and a results page.

    python benchmarks/gpu_limit.py --out docs/results/DATE-h200-limit [--settings ...]
        [--configs zero3 zeropp jit jit_fsdp nocomm]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import time

import pages

GPT = ["--arch", "gpt", "--model", "125m", "--seq", "1024"]
LLAMA7 = ["--arch", "llama", "--model", "7b", "--seq", "2048"]
LLAMA70 = ["--arch", "llama", "--model", "70b", "--seq", "4096"]
ON_4X8 = ["--batch", "32", "--nodes", "4", "--local", "8"]
ON_8X8 = ["--batch", "64", "--nodes", "8", "--local", "8"]
# name: zpp comm flags; one sequence per GPU.
SETTINGS = {
    "GPT 125m, 12 layers, 2 x 4": [*GPT, "--layers", "12", "--batch", "8"],
    "GPT 125m, 24 layers, 2 x 4": [*GPT, "--layers", "24", "--batch", "8"],
    "Llama 7B, 2 x 4": [*LLAMA7, "--batch", "8"],
    "Llama 7B, 2 x 8": [*LLAMA7, "--batch", "16", "--nodes", "2", "--local", "8"],
    "Llama 7B, 4 x 8": [*LLAMA7, "--batch", "32", "--nodes", "4", "--local", "8"],
    "Llama 70B, 4 x 8": [*LLAMA70, *ON_4X8],
    "Llama 70B, 8 x 8": [*LLAMA70, *ON_8X8],
    # Each unit keeps only its input for the backward pass (the engine's
    # configurations; the baselines keep what XLA keeps).
    "Llama 70B, 4 x 8, remat full": [*LLAMA70, *ON_4X8, "--remat", "full"],
    "Llama 70B, 8 x 8, remat full": [*LLAMA70, *ON_8X8, "--remat", "full"],
    # Tensor parallelism inside a node: one sequence per data group of `t`
    # GPUs, so the global batch is 32 / t (what TP is for: a smaller batch).
    **{
        f"Llama 70B, 4 x 8, TP {t}, remat full": [
            *LLAMA70,
            *["--batch", str(32 // t), "--nodes", "4", "--local", "8", "--tp", str(t)],
            *["--remat", "full"],
        ]
        for t in (2, 4, 8)
    },
    # The Llama 7B's widths at 8 layers on 2 x 8, each degree against plain
    # jax.jit at that degree (FSDP over the data devices, TP over `model`).
    **{
        f"Llama 7B, 8 layers, 2 x 8, TP {t}": [
            *LLAMA7,
            *["--layers", "8", "--batch", str(16 // t), "--nodes", "2", "--local", "8"],
            *(["--tp", str(t)] if t > 1 else []),
        ]
        for t in (1, 2, 4)
    },
}
# `zpp comm --configs` names; "nocomm" is the limit, and always compiled.
CONFIGS = ("zero3", "zeropp", "jit", "jit_fsdp", "nocomm")
LABELS = {
    "zero3": "ZeRO-3 (bf16 wire)",
    "zeropp": "ZeRO++",
    "jit": "jax.jit, XLA-partitioned",
    "jit_fsdp": "jax.jit, FSDP constraints",
    "nocomm": "no communication",
}
H200_MEMORY_GB = 141


# XLA's Triton one-shot all-reduce kernel fails to compile (an LLVM error,
# which aborts the process) for a scalar int32 all-reduce over 64 GPUs of one
# target topology; NCCL's all-reduce takes those few-byte reductions instead.
_XLA_FLAGS = "--xla_gpu_experimental_use_collective_kernels=-ALL_REDUCE"


def compile_reports(flags: list[str], configs: tuple[str, ...]) -> tuple[dict, float]:
    """(`zpp comm --target h200 --json` per config, seconds it took). Under
    `--tp` there is no no-communication step (it is one device's program of
    whole layers), so "nocomm" is left out there."""
    if "--tp" in flags:
        configs = tuple(c for c in configs if c != "nocomm")
    command = [sys.executable, "-m", "zpp_jax", "comm", "--target", "h200", "--json"]
    command += [*flags, "--compute-dtype", "bfloat16", "--configs", *configs]
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} {_XLA_FLAGS}".strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if run.returncode:
        sys.exit(f"zpp comm failed:\n{run.stderr[-3000:]}")
    reports = {r["name"]: _kept(r) for r in json.loads(run.stdout)["configs"]}
    return reports, time.perf_counter() - start


def _kept(report: dict) -> dict:
    """A report without its per-collective list and per-op exposure."""
    kept = {k: v for k, v in report.items() if k != "collectives"}
    if kept["estimate"]:
        kept["estimate"] = {k: v for k, v in kept["estimate"].items() if k != "exposed_by_op"}
    return kept


def rows(results: dict) -> list[dict]:
    """One row per setting and config: the numbers the page shows."""
    out = []
    for setting, (reports, _) in results.items():
        limit = reports["nocomm"]["estimate"]["step_us"] if "nocomm" in reports else None
        for config, r in reports.items():
            row = {"setting": setting, "config": config}
            row |= {"peak_gb": r["peak_memory_bytes"] / 1e9, "state_gb": r["state_bytes"] / 1e9}
            row |= {"nic_gb": r["cross_node_bytes"] / 1e9, "nvlink_gb": r["intra_node_bytes"] / 1e9}
            out.append(row | _estimated(r, limit))
    return out


def _estimated(report: dict, limit_us: float | None) -> dict:
    """The step's estimated times; None each where XLA gives no estimate
    (a program with a loop: plain jit of a scanned model), and the step
    over the limit None where no limit was compiled (tensor parallelism)."""
    est = report["estimate"]
    if est is None:
        keys = ("step_ms", "exposed_ms", "compute_ms", "nic_busy_ms", "nvlink_busy_ms")
        return dict.fromkeys((*keys, "mfu", "over_limit"))
    return {
        "step_ms": est["step_us"] / 1e3,
        "exposed_ms": sum(est["exposed_us"].values()) / 1e3,
        "compute_ms": est["compute_us"] / 1e3,
        "nic_busy_ms": est["link_busy_us"].get("nic", 0.0) / 1e3,
        "nvlink_busy_ms": est["link_busy_us"].get("nvlink", 0.0) / 1e3,
        "mfu": report["mfu"],
        "over_limit": None if limit_us is None else est["step_us"] / limit_us,
    }


def table(data: list[dict]) -> str:
    header = ["setting", "method", "step, ms", "exposed, ms", "compute alone, ms"]
    header += ["NIC busy, ms", "NVLink busy, ms", "MFU", "step / no-comm step"]
    header += ["NIC GB per GPU", "NVLink GB per GPU", "peak GB per GPU", "state GB per GPU"]
    body = [
        [
            r["setting"],
            LABELS[r["config"]],
            _shown(r["step_ms"], ".1f"),
            _shown(r["exposed_ms"], ".2f"),
            _shown(r["compute_ms"], ".1f"),
            _shown(r["nic_busy_ms"], ".1f"),
            _shown(r["nvlink_busy_ms"], ".1f"),
            _shown(r["mfu"], ".1%"),
            _shown(r["over_limit"], ".3f"),
            _shown(r.get("nic_gb"), ".2f"),
            _shown(r.get("nvlink_gb"), ".2f"),
            f"{r['peak_gb']:.1f}",
            f"{r['state_gb']:.1f}",
        ]
        for r in data
    ]
    return pages.table(header, body)


def _shown(value: float | None, spec: str) -> str:
    return "none" if value is None else format(value, spec)


def plot(data: list[dict], path: pathlib.Path) -> None:
    """Each method's step over the no-communication step per setting; where
    some setting has no limit compiled (tensor parallelism), its MFU."""
    import numpy as np

    settings = list(dict.fromkeys(r["setting"] for r in data))
    configs = [c for c in dict.fromkeys(r["config"] for r in data) if c != "nocomm"]
    limited = {r["setting"] for r in data if r["config"] == "nocomm"} == set(settings)
    key = "over_limit" if limited else "mfu"
    fig, ax = pages.figure(figsize=(10, 3.8))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        x = np.arange(len(settings)) + (i - (len(configs) - 1) / 2) * width
        value = [
            next(r[key] for r in data if r["setting"] == s and r["config"] == config)
            for s in settings
        ]
        ax.bar(x, [np.nan if v is None else v for v in value], width, label=LABELS[config])
        for xi, v in zip(x, value, strict=True):
            if v is None:  # XLA gives no estimate of a program with a loop
                ax.text(xi, 0.0, "no estimate\n(a loop)", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(np.arange(len(settings)), settings, fontsize=7, rotation=15)
    if limited:
        ax.axhline(1.05, color="black", lw=0.6, ls="--")
        ax.set_ylabel("step / no-communication step")
        ax.set_ylim(0.9, None)
        title = "H200s, compiled (not run): XLA's estimates; dashed: 1.05"
    else:
        ax.set_ylabel("MFU")
        title = "H200s, compiled (not run): MFU from XLA's estimated step"
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    pages.save(fig, path, titled=True)


REMAT_NOTE = (
    'In a setting named "remat full" ZeRO-3 and ZeRO++ keep only each layer\'s input and '
    "compute its forward pass again in the backward pass (`zpp comm --remat full`); the "
    "no-communication step and plain `jax.jit` keep what XLA keeps, so their steps have "
    "one forward pass fewer. "
)

TP_NOTE = (
    'In a setting named "TP t" each node\'s 8 GPUs are 8 / t data devices times a '
    "tensor-parallel split of t (`zpp comm --tp t`): each layer's matrix multiplies are "
    "split t ways inside a node, ZeRO-3 and ZeRO++ shard and gather each split over the "
    "data devices only (plain `jax.jit` splits each parameter along `model` as its names "
    "say, and over the data devices as FSDP does), and each data group of t GPUs takes "
    "one sequence, so the global batch is the GPUs / t sequences. MFU counts a GPU's "
    "share of the model FLOPs. No "
    "no-communication step is compiled there (it would be one device's program of whole "
    "layers), so the step over it is none. NIC and NVLink GB are the bytes a GPU sends "
    "across nodes and inside its node per step. "
)


def page(data: list[dict], results: dict, made: dict) -> str:
    costs = ", ".join(f"{s}: {seconds / 60:.0f} min" for s, (_, seconds) in results.items())
    configs = dict.fromkeys(r["config"] for r in data)
    names = "ZeRO-3, ZeRO++ and plain `jax.jit`" if "jit" in configs else "ZeRO-3 and ZeRO++"
    return (
        f"# {names} against the no-communication limit, compiled for H200s: "
        "XLA's estimates\n\n"
        f"Made by `{made['command']}` with the gpu-aot extra. "
        f"{pages.machine_line(made['machine'])}\n\n"
        "Each training step (AdamW, bf16 compute, one sequence per GPU) is compiled for H200 "
        "GPUs from XLA's H200 target description; nothing ran on a GPU. Every time is "
        "**XLA's estimate** (its scheduler's cost model on the schedule it made, the "
        "collectives priced on the engine's link model, 45 GB/s NIC and 400 GB/s NVLink "
        "per GPU, and run one at a time on one communication stream), not a measurement. "
        "All-reduces are NCCL's, not XLA's Triton one-shot kernel "
        f"(`XLA_FLAGS={_XLA_FLAGS}`: that kernel does not compile for 64 GPUs). "
        "The no-communication step is `NoCommunication`: the same model and per-GPU batch "
        "with nothing exchanged, one device's program (its optimizer updates the whole "
        "model, where the sharded steps update a GPU's share). Plain `jax.jit` "
        "(`zpp_jax.baseline.JitFSDP`) appears as XLA partitions it, and with its "
        "activations constrained to the batch axes as FSDP is written. "
        + (REMAT_NOTE if any("remat full" in s for s in results) else "")
        + (TP_NOTE if any(", TP " in s for s in results) else "")
        + "MFU is one GPU's model "
        "FLOPs (three times the forward pass's matrix multiplies, attention's included) "
        "over the step x 989 TFLOP/s, the H200's dense bf16 peak from the target "
        "description. Peak is `memory_analysis()`'s arguments + outputs + temporaries - "
        f"aliases, against the H200's {H200_MEMORY_GB} GB. Data: "
        "[gpu_limit.json](gpu_limit.json).\n\n"
        + table(data)
        + "\n\n![step over the limit](gpu_limit.png)\n\n"
        f"Compile time on this machine, per setting (its configurations together): {costs}.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="NAME"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["zero3", "zeropp"],
        choices=[c for c in CONFIGS if c != "nocomm"],
        help="compiled beside the limit (nocomm)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="settings compiled at once")
    parser.add_argument(
        "--render",
        action="store_true",
        help="draw the page and the plot again from OUT/gpu_limit.json, compiling nothing",
    )
    args = parser.parse_args()
    if args.render:
        render(args.out)
        return
    configs = (*args.configs, "nocomm")
    pages.prepare(args.out, "gpu_limit", args.overwrite)
    # Settings compile side by side, `--jobs` at a time (XLA compiles a
    # program on about one core).
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        each = list(pool.map(lambda s: compile_reports(SETTINGS[s], configs), args.settings))
    results = dict(zip(args.settings, each, strict=True))
    data = rows(results)
    made = {"command": pages.command(), "machine": pages.machine()}
    compiled = {s: {"reports": r, "compile_s": t} for s, (r, t) in results.items()}
    pages.write_json(args.out, "gpu_limit", {**made, "rows": data, "compiled": compiled})
    plot(data, args.out / "gpu_limit.png")
    pages.write_page(args.out, page(data, results, made))


def render(out: pathlib.Path) -> None:
    """The page and the plot of `out/gpu_limit.json`, as its run wrote them."""
    saved = json.loads((out / "gpu_limit.json").read_text())
    results = {s: (c["reports"], c["compile_s"]) for s, c in saved["compiled"].items()}
    plot(saved["rows"], out / "gpu_limit.png")
    pages.write_page(out, page(saved["rows"], results, saved))


if __name__ == "__main__":
    main()
