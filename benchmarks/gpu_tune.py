"""`zpp tune` for 2 nodes x 8 H200 GPUs at two NIC rates, compiled (not run).

    python benchmarks/gpu_tune.py --out docs/results/DATE-h200-tune
        [--model llama-7b] [--rates '100 Gbit/s'] [--tp 1,2,4] [--budget N]

For each rate of the NIC each GPU has (100 and 400 Gbit/s: 12.5 and 50
GB/s across nodes; NVLink's 400 GB/s inside a node), `zpp tune --target
h200` compiles the candidate settings for the GPT 125m (batch 16 x 1024
tokens; or the Llama 7B, 16 x 2048, with ``--model llama-7b``), at each
tensor-parallel degree of ``--tp`` if given, and ranks them by XLA's estimate of the step, with the
collectives priced on those links. Nothing runs on a GPU: the steps are
the scheduler's cost model, not measurements. Needs the gpu-aot extra and
``ZPP_GPU_TARGET_CONFIG``. Writes `gpu_tune.json`, `gpu_tune.png` and
`report.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pages

MODELS = {
    "gpt-125m": ["--arch", "gpt", "--model", "125m", "--seq", "1024", "--batch", "16"],
    "llama-7b": ["--arch", "llama", "--model", "7b", "--seq", "2048", "--batch", "16"],
}
MESH = ["--nodes", "2", "--local", "8"]
RATES = {"100 Gbit/s": 12.5, "400 Gbit/s": 50.0}  # per GPU, GB/s


def tune(gbps: float, flags: list[str], out: pathlib.Path) -> dict:
    """`zpp tune --target h200 FLAGS` at `gbps` across nodes: the provenance
    it wrote with the winner (its rows, compiles, seconds), its wall time
    and its table."""
    command = [sys.executable, "-m", "zpp_jax", "tune", "--target", "h200", "--quiet"]
    command += [*flags, "--link", f"intra=400,inter={gbps:g}", "--out", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.monotonic() - start
    if run.returncode:
        sys.exit(f"zpp tune failed:\n{run.stderr[-3000:]}")
    print(run.stdout, flush=True)
    return {**json.loads(out.read_text())["about"], "wall_s": wall, "table": run.stdout}


def plot(results: dict, path: pathlib.Path) -> None:
    fig, axes = pages.figure(1, len(results), figsize=(4.6 * len(results), 3.8), squeeze=False)
    for ax, (rate, r) in zip(axes[0], results.items(), strict=True):
        title = f"{rate} per GPU: chose {r['setting']} (red)"
        pages.ranked_steps(ax, r["rows"], r["setting"], 1e3, "XLA's estimated step, ms", title)
    pages.save(fig, path)


def _zero3(rows: list[dict]) -> tuple[str, str]:
    """(ZeRO-3's step, ZeRO-3's over the chosen one) as the page shows them:
    the estimate, or, where it was pruned, the bound its link time sets."""
    row = next(r for r in rows if r["name"] == "zero3")
    if row.get("step_s"):
        return f"{row['step_s'] * 1e3:.1f} ms", row["step_s"]
    return f"at least {row['bound_s'] * 1e3:.1f} ms (its link time; pruned)", row["bound_s"]


def page(result: dict) -> str:
    header = ["NIC per GPU", "zpp tune chose", "its step", "ZeRO-3's step", "ZeRO-3 / chosen"]
    header += ["compiles", "wall time"]
    rows, tables = [], []
    for rate, r in result["rates"].items():
        zero3_ms, zero3 = _zero3(r["rows"])
        ratio = f"{zero3 / r['step_s']:.2f}" + ("" if "pruned" not in zero3_ms else " or more")
        rows.append(
            [rate, r["setting"], f"{r['step_s'] * 1e3:.1f} ms", zero3_ms, ratio,
             r["compiles"], f"{r['wall_s']:.0f} s"]
        )  # fmt: skip
        tables.append(f"### {rate}\n\n```\n{r['table'].strip()}\n```\n")
    flags = result.get("flags", MODELS["gpt-125m"] + MESH)
    count = "one NIC rate" if len(result["rates"]) == 1 else f"{len(result['rates'])} NIC rates"
    return (
        f"# zpp tune for 2 x 8 H200s at {count}: XLA's estimates\n\n"
        f"Made by `{result['command']}` with the gpu-aot extra. "
        f"{pages.machine_line(result['machine'])}\n\n"
        f"`zpp tune --target h200 {' '.join(flags)} --link intra=400,inter=RATE`, "
        "RATE the GB/s of the NIC each GPU has. Each candidate's training step (AdamW, bf16 "
        "compute) is compiled for 2 nodes x 8 H200 GPUs from XLA's H200 target description "
        "and ranked by **XLA's estimate** of its step (its scheduler's cost model on the "
        "schedule it made, the collectives priced on the given links), not a measurement. "
        + (TP_NOTE if "--tp" in flags else "")
        + "The gradient error is measured on CPU devices with the architecture's tiny "
        "preset. Wall time is on "
        "this machine, compiling on its cores. Data: [gpu_tune.json](gpu_tune.json).\n\n"
        + pages.table(header, rows)
        + "\n\n![every compiled setting per rate](gpu_tune.png)\n\n"
        "## Each run's ranked table\n\n" + "\n".join(tables)
    )


TP_NOTE = (
    "`--tp` searches the tensor-parallel degrees too: each setting at each degree (a "
    "node's 8 GPUs as 8 / t data devices times t), the global batch the same; below each "
    "table a line per degree gives its fastest setting and what bounds its step. "
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--render", action="store_true", help="only redraw the page from --out's gpu_tune.json"
    )
    parser.add_argument("--model", choices=list(MODELS), default="gpt-125m")
    parser.add_argument("--rates", nargs="+", choices=list(RATES), default=list(RATES))
    parser.add_argument("--tp", help="zpp tune --tp: the tensor-parallel degrees to search")
    parser.add_argument("--budget", type=int, help="zpp tune --budget")
    args = parser.parse_args()
    flags = [*MODELS[args.model], *MESH]
    flags += ["--tp", args.tp] if args.tp else []
    flags += ["--budget", str(args.budget)] if args.budget else []
    if args.render:
        result = json.loads((args.out / "gpu_tune.json").read_text())
    else:
        pages.prepare(args.out, "gpu_tune", args.overwrite)
        with tempfile.TemporaryDirectory() as tmp:
            results = {
                rate: tune(RATES[rate], flags, pathlib.Path(tmp) / f"{RATES[rate]:g}.json")
                for rate in args.rates
            }
        made = {"command": pages.command(), "machine": pages.machine(), "flags": flags}
        result = {**made, "rates": results}
        pages.write_json(args.out, "gpu_tune", result)
    plot(result["rates"], args.out / "gpu_tune.png")
    pages.write_page(args.out, page(result))


if __name__ == "__main__":
    main()
