"""A results page from what `benchmarks/gpu/run.py --json DIR` wrote:
`DIR/report.md` (the kernels' bit-exactness, their bandwidth next to a
plain elementwise op timed the same way, the step times) and
`DIR/bandwidth.png`.

    python benchmarks/gpu/report.py docs/results/2026-12-04-h200
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("dir", type=Path)
args = parser.parse_args()
gpu = json.loads((args.dir / "gpu.json").read_text())
kernels = json.loads((args.dir / "kernels.json").read_text())

lines = [
    f"Device: {gpu['device']}, jax {gpu['jax']}.",
    "",
    "## Kernels against the plain-JAX reference",
    "",
]
checks = gpu.get("kernels", [])
same = sum(k["bit_identical"] for k in checks)
lines.append(f"{same} of {len(checks)} kernel cases bit-identical (codes and scales):")
for k in checks:
    verdict = "bit-identical" if k["bit_identical"] else "DIFFERS"
    lines.append(f"- {k['op']}, int{k['bits']}, {k['rounding']}: {verdict}")
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
        f"| {r['op']} | {r['mib']} | {r['ms']:.3f} | {r['gbs']:,.0f} | {r['copy_gbs']:,.0f} "
        f"| {r['gbs'] / r['copy_gbs']:.0%} |"
    )
lines += ["", "## Training steps", ""]
if gpu.get("step_s"):
    base = gpu["step_s"].get("plain jax.jit")
    for name, t in gpu["step_s"].items():
        ratio = f", {t / base:.2f}x plain jit" if base else ""
        lines.append(f"- {name}: {1e3 * t:.1f} ms{ratio}")
for part, error in gpu.get("errors", {}).items():
    lines.append(f"- {part}: not measured, {error.splitlines()[0][:200]}")
(args.dir / "report.md").write_text("\n".join(lines) + "\n")

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
ax.set_title(f"block-quantization kernels, {gpu['device']}")
ax.legend()
fig.tight_layout()
fig.savefig(args.dir / "bandwidth.png", dpi=100)
print((args.dir / "report.md").read_text())
