"""The results page of `run.py --out DIR`: `two_nodes.json`, `two_nodes.png`
and `report.md`, from the records the nodes printed."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import pages  # noqa: E402

LABELS = {
    "zero3": "ZeRO-3 (bf16 wire)",
    "zeropp": "ZeRO++",
    "jit": "jax.jit, XLA-partitioned",
    "jit_fsdp": "jax.jit, FSDP constraints",
}

METHOD = """\
Two network namespaces joined by a veth pair, each end shaped with `tc ...
tbf` to the rate, and one `jax.distributed` process with 4 CPU devices in
each: a 2 x 4 mesh, collectives over gloo/TCP. Each process compiles each
method's GPT training step once; then, for every rate, both shape their own
end of the link, meet at a barrier, warm up and time the step (median). The
methods are ZeRO-3 (bf16 gathers and gradients), ZeRO++ (int8 weights + hpZ +
int4 gradients) and plain `jax.jit` in two forms: the unsharded NNX model with
parameters and Adam state sharded FSDP-style with `NamedSharding` and XLA's
partitioner choosing the rest ("jit", which may move activations instead of
weights), and the same with every layer's activations constrained to the batch
axes ("jit (FSDP)", FSDP as MaxText writes it: XLA gathers the weights). Both
compute and communicate in the model's fp32. The bytes that crossed the link
are read from the veth counters (the busier direction). A tbf shaper lets a
sender push its bucket at the veth's own speed after an idle spell, where a
real link serializes every byte, so the bucket is 1 ms of the rate (16 KiB at
least). Each method's floor is max(its step on the unshaped link, its link
bytes / rate); "step / floor" is how far it is from it. The 8 emulated devices
share the machine's cores, so every method's compute is slower than on 8 real
devices; steps move by 10-20% from run to run, so ratios near 1 are ties."""


def key(r: dict) -> tuple[int, int]:
    return r["model"]["d_model"], r["tokens_per_device"]


def summary(records: list[dict]) -> list[str]:
    """Per rate: the range over models of ZeRO++'s speedup against each
    baseline, and of the link bytes ZeRO-3 moves over ZeRO++'s."""
    by: dict = {}
    for r in records:
        by.setdefault(r.get("rate") or "no network", {}).setdefault(key(r), {})[r["method"]] = r
    lines = []
    for rate, cases in by.items():
        full = [c for c in cases.values() if {"zero3", "zeropp"} <= set(c)]
        if not full:
            continue
        speedups = []
        for other in ("zero3", "jit", "jit_fsdp"):
            ratios = [c[other]["median_s"] / c["zeropp"]["median_s"] for c in full if other in c]
            if ratios:
                speedups.append(f"{_span(ratios, '.2f')}x as fast as {LABELS[other]}")
        line = f"- **{rate}**, {len(full)} model and batch sizes: ZeRO++ is " + ", ".join(speedups)
        if rate != "no network":
            moved = [_bytes(c["zero3"]) / _bytes(c["zeropp"]) for c in full]
            line += f"; ZeRO-3 moves {_span(moved, '.1f')}x its bytes over the link"
        lines.append(line + ".")
    return lines


def _bits(rate: str) -> float:
    import shaping

    return float("inf") if rate in ("unshaped", "no network") else shaping.rate_bits(rate)


def _span(values: list[float], spec: str) -> str:
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}-{high}"


def _bytes(r: dict) -> float:
    return max(r["link_tx_bytes"], r["link_rx_bytes"])


def plot(records: list[dict], path: pathlib.Path) -> None:
    cases = sorted({key(r) for r in records})
    rates = sorted(
        {r.get("rate") or "no network" for r in records},
        key=lambda rate: -_bits(rate),  # the fastest link first
    )
    cols = min(len(cases), 3)
    rows = -(-len(cases) // cols)
    fig, axes = pages.figure(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(cases) :]:
        ax.set_visible(False)
    for ax, case in zip(axes.flat, cases, strict=False):
        for method, label in LABELS.items():
            steps = {
                (r.get("rate") or "no network"): r["median_s"]
                for r in records
                if key(r) == case and r["method"] == method
            }
            xs = [i for i, rate in enumerate(rates) if rate in steps]
            ax.plot(xs, [steps[rates[i]] for i in xs], "o-", label=label)
        ax.set_xticks(range(len(rates)), rates, fontsize=8)
        ax.set_title(f"d_model {case[0]}, {case[1]} tokens/device", fontsize=9)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("step, s (median)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Two processes x 4 CPU devices over a shaped link", fontsize=10)
    pages.save(fig, path, titled=True)


LOCAL = """\
One process with 8 CPU devices on a 2 x 4 mesh: every collective in memory,
no link at all. What is left is each method's compute and its
quantization kernels, on devices that share the machine's cores and memory
bus (so every ZeRO method, which runs each layer against the full weight on
each device, reads the weights 8 times over one bus, where jit's
partitioned program reads each once, in eighths)."""


def text(result: dict, table: str) -> str:
    linked = any(r.get("rate") for r in result["records"])
    title = "Two nodes over a shaped link" if linked else "Two nodes with no link: the compute"
    return (
        f"# {title}\n\n"
        f"Made by `{result['command']}`{' (as root)' if linked else ''}. "
        f"{pages.machine_line(result['machine'])}\n\n"
        + (METHOD if linked else LOCAL)
        + "\n\nModels: the GPT of `benchmarks/cluster/node.py` with 4 layers, byte vocabulary, "
        "fp32 compute, d_ff 4 x d_model; the batch is 8 sequences of `tokens/device` "
        "tokens, one per device. Data: [two_nodes.json](two_nodes.json).\n\n"
        + "\n".join(summary(result["records"]))
        + "\n\n"
        + table
        + "\n\n![step per link rate](two_nodes.png)\n"
    )


def write(out: pathlib.Path, records: list[dict], table: str) -> None:
    result = {"command": pages.command(), "machine": pages.machine(), "records": records}
    pages.write_json(out, "two_nodes", result)
    render(out, result, table)


def render(out: pathlib.Path, result: dict, table: str) -> None:
    """The plot and the page of `result` (what `write` saved) in `out`."""
    plot(result["records"], out / "two_nodes.png")
    pages.write_page(out, text(result, table))


def prepare(out: pathlib.Path, overwrite: bool) -> None:
    pages.prepare(out, "two_nodes", overwrite)
