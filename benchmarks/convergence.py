"""Convergence of ZeRO++ against ZeRO-3: the tiny GPT trained on the default
corpus (2 x 4 emulated devices) with ZeRO-3 (bf16 wire), qwZ+hpZ+qgZ, and
qwZ+hpZ+qgZ with error feedback; same seed, same batches.

Reports per run the training loss (mean of the last 20 steps, which smooths
the single-batch noise) and the validation loss at the end (16 held-out
batches), and each one's difference from ZeRO-3. Writes `convergence.json`,
`convergence.png` and `report.md` in --out.

    python benchmarks/convergence.py --out docs/results/DATE-convergence --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import os
import pathlib

import pages

LABELS = {
    "zero3": "ZeRO-3 (bf16 wire)",
    "zeropp": "qwZ+hpZ+qgZ",
    "zeropp+ef": "qwZ+hpZ+qgZ, error feedback",
}


def configs() -> dict:
    from zpp_jax import ZeroPPConfig

    return {
        "zero3": ZeroPPConfig.zero3(),
        "zeropp": ZeroPPConfig(comm_dtype="bfloat16"),
        "zeropp+ef": ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True),
    }


def train(zero, model: str, steps: int, seed: int) -> dict:
    """Per-step training losses and the final validation loss of one run."""
    from zpp_jax.recipes import RunConfig, run

    cfg = RunConfig(
        zero=zero,
        model=model,
        steps=steps,
        seed=seed,
        eval_every=0,
        eval_batches=16,
        progress=False,
    )
    records = run(cfg)
    return {"loss": [r["loss"] for r in records], "val_loss": records[-1]["val_loss"]}


def summary(runs: dict) -> list[list]:
    """Table rows: per seed, each config's train / val loss and its
    difference from ZeRO-3's."""
    rows = []
    for seed, by in runs.items():
        base = by["zero3"]
        cells = [seed]
        for name, r in by.items():
            train = sum(r["loss"][-20:]) / len(r["loss"][-20:])
            base_train = sum(base["loss"][-20:]) / len(base["loss"][-20:])
            if name == "zero3":
                cells.append(f"{train:.4f} / {r['val_loss']:.4f}")
            else:
                dt, dv = train / base_train - 1, r["val_loss"] / base["val_loss"] - 1
                cells.append(f"{train:.4f} ({dt:+.2%}) / {r['val_loss']:.4f} ({dv:+.2%})")
        rows.append(cells)
    return rows


def plot(runs: dict, path: pathlib.Path) -> None:
    import numpy as np

    fig, ax = pages.figure(figsize=(6.5, 3.8))
    window = 20
    for seed, by in runs.items():
        base = np.convolve(by["zero3"]["loss"], np.ones(window) / window, mode="valid")
        for name, color in (("zeropp", "C1"), ("zeropp+ef", "C2")):
            ours = np.convolve(by[name]["loss"], np.ones(window) / window, mode="valid")
            label = LABELS[name] if seed == next(iter(runs)) else None
            ax.plot(
                np.arange(window, window + len(base)),
                100 * (ours / base - 1),
                color=color,
                alpha=0.8,
                lw=0.9,
                label=label,
            )
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss vs ZeRO-3, % ({window}-step mean)")
    ax.set_title("Each seed's run against ZeRO-3's on the same batches", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    pages.save(fig, path)


def page(result: dict) -> str:
    header = ["seed", *(f"{LABELS[n]} train / val" for n in LABELS)]
    return (
        "# Convergence against ZeRO-3\n\n"
        f"Made by `{result['command']}`. {pages.machine_line(result['machine'])}\n\n"
        f"The `{result['model']}` GPT, 16 x 64 tokens per step on 2 x 4 emulated devices, "
        f"{result['steps']} steps of `zpp_jax.recipes.run` on the default corpus with each "
        "configuration at its defaults. Training loss is the mean of the last 20 steps, "
        "validation loss is over 16 held-out batches at the end; in brackets the difference "
        "from ZeRO-3 on the same seed and batches. Data: [convergence.json](convergence.json).\n\n"
        + pages.table(header, summary(result["runs"]))
        + "\n\n![difference from ZeRO-3](convergence.png)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    pages.prepare(args.out, "convergence", args.overwrite)
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    runs = {
        seed: {name: train(zero, args.model, args.steps, seed) for name, zero in configs().items()}
        for seed in args.seeds
    }
    result = {
        "command": pages.command(),
        "machine": pages.machine(),
        "model": args.model,
        "steps": args.steps,
        "runs": runs,
    }
    pages.write_json(args.out, "convergence", result)
    plot(runs, args.out / "convergence.png")
    pages.write_page(args.out, page(result))


if __name__ == "__main__":
    main()
