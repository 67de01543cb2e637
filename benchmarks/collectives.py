"""Time the engine's collectives on the current devices (8 emulated CPU
devices by default): plain vs quantized all-gather, plain vs hierarchical
quantized reduce-scatter, with the bytes each moves per device.

    python benchmarks/collectives.py --elements 16777216 --nodes 2 --local 4
"""

import argparse
import os
import statistics
import time

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--elements", type=int, default=1 << 24, help="full vector length")
parser.add_argument("--nodes", type=int, default=2)
parser.add_argument("--local", type=int, default=4)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.nodes * args.local))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from zpp_jax import collectives, make_mesh  # noqa: E402
from zpp_jax.analysis import summarize  # noqa: E402
from zpp_jax.lowlevel import AXES  # noqa: E402

mesh = make_mesh(args.nodes, args.local)
n = args.nodes * args.local
size = args.elements // n * n
shard = jax.device_put(jnp.ones((size,)), NamedSharding(mesh, P(AXES)))
full = jax.device_put(jnp.ones((n, size)), NamedSharding(mesh, P(AXES, None)))

cases = {
    "all-gather fp32": (lambda s: collectives.all_gather(s)[None], shard, P(AXES)),
    "all-gather bf16": (lambda s: collectives.all_gather(s, jnp.bfloat16)[None], shard, P(AXES)),
    "all-gather int8 (qwZ)": (
        lambda s: collectives.quantized_all_gather(s, 8, 256)[None],
        shard,
        P(AXES),
    ),
    "reduce-scatter fp32": (lambda g: collectives.reduce_scatter(g[0]), full, P(AXES, None)),
    "reduce-scatter bf16": (
        lambda g: collectives.reduce_scatter(g[0], jnp.bfloat16),
        full,
        P(AXES, None),
    ),
    "hierarchical int4 (qgZ)": (
        lambda g: collectives.hierarchical_reduce_scatter(g[0], 4, 256)[0],
        full,
        P(AXES, None),
    ),
}
print(f"{n} devices ({args.nodes} x {args.local}), full vector {size:,} fp32 elements")
print(f"{'collective':26s}{'median ms':>11s}{'cross-node MB':>15s}{'intra-node MB':>15s}")
for name, (fn, arg, spec) in cases.items():
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P(AXES), check_vma=False))
    compiled = f.lower(arg).compile()
    moved = summarize(compiled.as_text(), args.local)
    jax.block_until_ready(compiled(arg))
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(arg))
        times.append(time.perf_counter() - t)
    print(
        f"{name:26s}{1e3 * statistics.median(times):11.1f}"
        f"{moved.cross_node_bytes / 1e6:15.2f}{moved.intra_node_bytes / 1e6:15.2f}"
    )
