"""The main job from Python: train the tiny GPT with ZeRO++ on 2 x 4 emulated
devices (same as `zpp train`), then with plain ZeRO-3, and compare.

    python examples/train_gpt.py --steps 100
"""

import argparse
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

from zpp_jax import ZeroPPConfig  # noqa: E402
from zpp_jax.recipes import RunConfig, run  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()

results = {}
for name, zero in [
    ("ZeRO++", ZeroPPConfig(comm_dtype="bfloat16")),
    ("ZeRO-3", ZeroPPConfig.zero3()),
]:
    records = run(RunConfig(zero=zero, steps=args.steps, eval_every=0, progress=False))
    results[name] = records[-1]
for name, last in results.items():
    print(
        f"{name}: loss {last['loss']:.4f}, val_loss {last['val_loss']:.4f}, "
        f"{last['cross_node_bytes']:,.0f} cross-node bytes per device per step"
    )
