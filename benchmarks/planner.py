"""How long the TeraPipe planner takes on the paper's settings.

For each GPT-3 setting (layers, hidden, stages; 2048 tokens, granularity 8,
the analytic cost model), the wall time of `plan_tokens` and `best_uniform`,
with the plan's predicted speedup over the best uniform slicing.

    python benchmarks/planner.py
"""

import argparse
import math
import time

from zpp_jax.pipeline import AnalyticCost, best_uniform, plan_tokens

SETTINGS = {  # name: (layers, hidden, stages), as in the TeraPipe paper
    "GPT3-1B": (24, 2048, 12),
    "GPT3-13B": (40, 5120, 20),
    "GPT3-44B": (96, 6144, 24),
    "GPT3-175B": (96, 12288, 48),
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--granularity", type=int, default=8)
parser.add_argument("--objective", default="pipeline", choices=("pipeline", "lockstep"))
args = parser.parse_args()

header = ("setting", 11), ("stages", 7), ("plan s", 9), ("uniform s", 11), ("slices", 8)
print("".join(f"{h:{'<' if i == 0 else '>'}{w}s}" for i, (h, w) in enumerate(header)), "vs uniform")
for name, (layers, hidden, stages) in SETTINGS.items():
    cost = AnalyticCost(hidden=hidden, layers=math.ceil(layers / stages))
    kw = dict(granularity=args.granularity, objective=args.objective)
    start = time.perf_counter()
    plan = plan_tokens(args.seq, stages, cost, **kw)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    uniform = best_uniform(args.seq, stages, cost, **kw)
    uniform_s = time.perf_counter() - start
    print(
        f"{name:11s}{stages:7d}{plan_s:9.3f}{uniform_s:11.3f}{len(plan.slices):8d}"
        f"{uniform.latency / plan.latency:11.3f}x"
    )
