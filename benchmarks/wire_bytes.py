"""What each configuration's compiled step moves per device, across nodes
and inside them: `zpp comm --json` on emulated CPU devices (the ring model
of the compiled program's collectives, counted per device per step) for the
GPT 125m on a 2 x 4 and a 4 x 4 mesh. Byte counts, not times: they do not
depend on the machine. Writes `wire_bytes.json`, `wire_bytes.png` and
`report.md` in --out.

    python benchmarks/wire_bytes.py --out docs/results/DATE-wire-bytes
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pages

CONFIGS = ("zero3", "qwz", "hpz", "qgz", "zeropp", "jit", "jit_fsdp")
MESHES = {"2 x 4": ("2", "4", "8"), "4 x 4": ("4", "4", "16")}  # nodes, local, batch


def compile_reports(nodes: str, local: str, batch: str) -> dict:
    """`zpp comm --json` for the GPT 125m: report per config."""
    command = [sys.executable, "-m", "zpp_jax", "comm", "--json", "--arch", "gpt"]
    command += ["--model", "125m", "--nodes", nodes, "--local", local, "--batch", batch]
    command += ["--configs", *CONFIGS]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if run.returncode:
        sys.exit(f"zpp comm failed:\n{run.stderr[-3000:]}")
    reports = json.loads(run.stdout)["configs"]
    return {r["name"]: {k: v for k, v in r.items() if k != "collectives"} for r in reports}


def rows(reports: dict) -> list[list]:
    out = []
    for config in CONFIGS:
        cells = [config]
        for by in reports.values():
            r, base = by[config], by["zero3"]["cross_node_bytes"]
            cells += [f"{r['cross_node_bytes']:,.0f}", f"{base / r['cross_node_bytes']:.2f}x"]
            cells.append(f"{r['intra_node_bytes']:,.0f}")
        out.append(cells)
    return out


def plot(reports: dict, path: pathlib.Path) -> None:
    fig, ax = pages.figure(figsize=(6.5, 3.5))
    width = 0.8 / len(reports)
    for i, (mesh, by) in enumerate(reports.items()):
        xs = [j + (i - (len(reports) - 1) / 2) * width for j in range(len(CONFIGS))]
        ax.bar(xs, [by[c]["cross_node_bytes"] / 1e6 for c in CONFIGS], width, label=mesh)
    ax.set_xticks(range(len(CONFIGS)), CONFIGS)
    ax.set_yscale("log")
    ax.set_ylabel("MB across nodes per device per step")
    ax.set_title("GPT 125m, 1,024 tokens per sequence, one sequence per device", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    pages.save(fig, path)


def page(result: dict) -> str:
    header = ["config"]
    for mesh in result["reports"]:
        header += [f"{mesh}: cross-node B", "ZeRO-3 / this", f"{mesh}: intra-node B"]
    return (
        "# What a step moves, per technique\n\n"
        f"Made by `{result['command']}`. {pages.machine_line(result['machine'])}\n\n"
        "Each configuration's GPT 125m training step (1,024 tokens per sequence, one "
        "sequence per device, AdamW) compiled on emulated CPU devices; the bytes each device "
        "sends per step under the ring model of the compiled program's collectives, "
        "across nodes and inside them. `jit` is plain `jax.jit` with FSDP-style shardings "
        "(`zpp_jax.baseline.JitFSDP`): XLA's partitioner reshards activations between layers "
        "instead of gathering weights, in fp32 on CPU (XLA:CPU widens bf16 collectives). "
        "`jit_fsdp` is the same with every layer's activations constrained to the batch axes "
        "(`JitFSDP(constrain_activations=True)`), so that XLA gathers the weights as FSDP "
        "does. These are counts of the program, not of a link: what crosses a real link is on the "
        "two-node pages. Data: [wire_bytes.json](wire_bytes.json).\n\n"
        + pages.table(header, rows(result["reports"]))
        + "\n\n![bytes across nodes](wire_bytes.png)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    pages.prepare(args.out, "wire_bytes", args.overwrite)
    reports = {mesh: compile_reports(*shape) for mesh, shape in MESHES.items()}
    result = {"command": pages.command(), "machine": pages.machine(), "reports": reports}
    pages.write_json(args.out, "wire_bytes", result)
    plot(reports, args.out / "wire_bytes.png")
    pages.write_page(args.out, page(result))


if __name__ == "__main__":
    main()
