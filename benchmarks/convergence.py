"""Convergence of ZeRO++ against ZeRO-3: the tiny GPT trained on the default
corpus (2 x 4 emulated devices) with ZeRO-3 (bf16 wire), qwZ+hpZ+qgZ, and
qwZ+hpZ+qgZ with error feedback; same seed, same batches.

Reports per run the training loss (mean of the last 20 steps, which smooths
the single-batch noise) and the validation loss at the end (16 held-out
batches), and each one's difference from ZeRO-3.

    python benchmarks/convergence.py --steps 300 --seeds 0 1 2
"""

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--seeds", type=int, nargs="+", default=[0])
parser.add_argument("--model", default="tiny")
args = parser.parse_args()
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

from zpp_jax import ZeroPPConfig  # noqa: E402
from zpp_jax.recipes import RunConfig, run  # noqa: E402

CONFIGS = {
    "zero3": ZeroPPConfig.zero3(),
    "zeropp": ZeroPPConfig(comm_dtype="bfloat16"),
    "zeropp+ef": ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True),
}
print(f"{'seed':>4s} {'config':10s} {'train (last 20)':>16s} {'diff':>7s} {'val':>8s} {'diff':>7s}")
for seed in args.seeds:
    base = None
    for name, zero in CONFIGS.items():
        recs = run(
            RunConfig(
                zero=zero,
                model=args.model,
                steps=args.steps,
                seed=seed,
                eval_every=0,
                eval_batches=16,
                progress=False,
            )
        )
        train = float(np.mean([r["loss"] for r in recs[-20:]]))
        val = recs[-1]["val_loss"]
        base = base or (train, val)
        print(
            f"{seed:4d} {name:10s} {train:16.4f} {100 * (train / base[0] - 1):+6.2f}% "
            f"{val:8.4f} {100 * (val / base[1] - 1):+6.2f}%",
            flush=True,
        )
