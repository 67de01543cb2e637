"""A results page from what `benchmarks/gpu/run.py --json DIR` wrote:
`DIR/report.md` (the kernels' bit-exactness, their bandwidth next to a
plain elementwise op timed the same way, the step times beside XLA's
estimates) and `DIR/bandwidth.png`. `run.py` calls it; run it again to
redraw a page from its JSON.

    python benchmarks/gpu/report.py docs/results/2026-12-04-h200
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pages  # noqa: E402  (benchmarks/pages.py: what every results page states)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def kernel_lines(gpu: dict, kernels: dict) -> list[str]:
    checks = gpu.get("kernels", [])
    same = sum(k["bit_identical"] for k in checks)
    lines = ["## Kernels against the plain-JAX reference", ""]
    lines.append(f"{same} of {len(checks)} kernel cases bit-identical (codes and scales):")
    for k in checks:
        verdict = "bit-identical" if k["bit_identical"] else "DIFFERS"
        size = f", {k['size']:,} elements" if "size" in k else ""  # older pages lack it
        lines.append(f"- {k['op']}{size}, int{k['bits']}, {k['rounding']}: {verdict}")
    lines += [
        "",
        "## Bandwidth",
        "",
        "Bytes each op must read and write over its median time (one call, then a",
        "host sync). `copy` is `x + 1` on the same bf16 input, timed the same way:",
        "the ratio to it is the share of what this timing reaches, not of the",
        f"device's {kernels['peak_gbs']:,.0f} GB/s.",
        "",
        "| op | MiB | ms | GB/s | copy GB/s | vs copy |",
        "|---|---|---|---|---|---|",
    ]
    for r in kernels["rows"]:
        lines.append(
            f"| {r['op']} | {r['mib']} | {r['ms']:.3f} | {r['gbs']:,.0f} | "
            f"{r['copy_gbs']:,.0f} | {r['gbs'] / r['copy_gbs']:.0%} |"
        )
    return lines


def step_lines(gpu: dict) -> list[str]:
    steps, guesses = gpu.get("step_s", {}), gpu.get("estimate_s", {})
    lines = [
        "",
        "## Training steps on one device",
        "",
        f"GPT {gpu.get('model')}, batch {gpu.get('batch')}, a 1 x 1 mesh: no collective runs,",
        "so each method's step is its compute and its own kernels. Measured: the",
        "median step. Estimated: XLA's latency-hiding scheduler's cost model over",
        "the schedule it made for the same compile (what the compile-only pages",
        "report), and the measured step over it.",
        "",
        "| method | measured ms | vs plain jit | XLA's estimate ms | measured / estimate |",
        "|---|---|---|---|---|",
    ]
    base = steps.get("plain jax.jit")
    for name, t in steps.items():
        ratio = f"{t / base:.2f}x" if base else "-"
        guess = guesses.get(name)
        estimate = "-" if guess is None else f"{1e3 * guess:.1f}"
        calibration = "-" if guess is None else f"{t / guess:.2f}"
        lines.append(f"| {name} | {1e3 * t:.1f} | {ratio} | {estimate} | {calibration} |")
    for part, error in gpu.get("errors", {}).items():
        lines.append(f"- {part}: not measured, {error.splitlines()[0][:200]}")
    return lines


def bandwidth_plot(gpu: dict, kernels: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = sorted({r["mib"] for r in kernels["rows"]})
    ops = list(dict.fromkeys(r["op"] for r in kernels["rows"]))
    width = 0.8 / len(sizes)
    for i, mib in enumerate(sizes):
        rows = {r["op"]: r for r in kernels["rows"] if r["mib"] == mib}
        ax.bar(
            [j + i * width for j in range(len(ops))],
            [rows[o]["gbs"] / rows[o]["copy_gbs"] for o in ops],
            width,
            label=f"{mib} MiB",
        )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(ops))])
    ax.set_xticklabels(ops, rotation=40, ha="right", fontsize=7)
    ax.set_ylabel("bandwidth / copy's")
    ax.set_title(f"block-quantization kernels, {gpu['device']}, jax {gpu['jax']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_page(folder: Path) -> str:
    gpu = json.loads((folder / "gpu.json").read_text())
    kernels = json.loads((folder / "kernels.json").read_text())
    versions = ", ".join(f"{n} {gpu[n]}" for n in ("jax", "jaxlib", "flax", "optax") if n in gpu)
    lines = [f"# Kernels and one device's training step: {gpu['device']}", ""]
    if "command" in gpu:  # pages written before the command was recorded lack it
        lines += [f"Made by `{gpu['command']}`. {pages.machine_line(gpu['machine'])}", ""]
    lines += [f"Device: {gpu['device']}; {versions}.", ""]
    lines += kernel_lines(gpu, kernels) + step_lines(gpu)
    text = "\n".join(lines) + "\n"
    (folder / "report.md").write_text(text)
    bandwidth_plot(gpu, kernels, folder / "bandwidth.png")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", type=Path)
    print(write_page(parser.parse_args().dir))
