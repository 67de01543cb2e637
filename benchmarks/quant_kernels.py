"""Throughput of the block-quantization kernels.

For each op and input size (MiB of bf16 input), the median time and the
effective bandwidth: bytes the op must read plus write, over its time. On a
GPU, also the fraction of the device's memory bandwidth (`--peak-gbs`, H200:
4800 GB/s); on CPU (where the ops run their plain-JAX reference), next to a
plain copy of the same number of bytes.

    python benchmarks/quant_kernels.py --mib 64 256 1024 [--json kernels.json]
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from zpp_jax import quant

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--mib", type=int, nargs="+", default=[64, 256, 1024])
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--block", type=int, default=256)
parser.add_argument("--peak-gbs", type=float, default=4800.0)
parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
args = parser.parse_args()
gpu = jax.default_backend() == "gpu"


def timed(f, *xs):
    jax.block_until_ready(f(*xs))
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*xs))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), block {args.block}")
print(
    f"{'op':28s}{'MiB':>6s}{'ms':>9s}{'GB/s':>9s}"
    + ("{:>9s}".format("% peak") if gpu else "{:>11s}".format("copy GB/s"))
)
rows = []
for mib in args.mib:
    n = mib * (1 << 20) // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy_t = timed(jax.jit(lambda a: a + jnp.bfloat16(1)), x)
    residual = jnp.zeros((4, 2, n // 8), jnp.float32)
    for bits in (8, 4):
        q = jax.jit(lambda a, bits=bits: pk.quantize(a, bits, args.block))(x)
        qk = jax.tree.map(lambda a: jnp.stack([a] * 4), q)
        q_bytes = quant.wire_bytes(n, bits, args.block)
        cases = [
            (
                f"quantize int{bits}",
                lambda a, b=bits: pk.quantize(a, b, args.block),
                (x,),
                2 * n + q_bytes,
            ),
            (
                f"dequantize int{bits} -> bf16",
                lambda q, b=bits, n=n: pk.dequantize(q, b, n, jnp.bfloat16),
                (q,),
                q_bytes + 2 * n,
            ),
            (
                # the residual is fp32, read and written
                f"quantize + feedback int{bits}",
                lambda a, r, b=bits: pk.quantize_reordered_with_feedback(a, r, 2, 4, b, args.block),
                (x, residual),
                2 * n + q_bytes + 8 * n,
            ),
            (
                f"dequant-sum4-quant int{bits}",
                lambda q, b=bits, n=n: pk.dequantize_sum_quantize(q, b, n),
                (qk,),
                5 * q_bytes,
            ),
        ]
        for name, f, xs, nbytes in cases:
            t = timed(jax.jit(f), *xs)
            gbs = nbytes / t / 1e9
            extra = f"{100 * gbs / args.peak_gbs:8.1f}%" if gpu else f"{4 * n / copy_t / 1e9:11.1f}"
            print(f"{name:28s}{mib:6d}{1e3 * t:9.2f}{gbs:9.1f}{extra}", flush=True)
            rows.append(
                {
                    "op": name,
                    "mib": mib,
                    "ms": 1e3 * t,
                    "gbs": gbs,
                    "copy_gbs": 4 * n / copy_t / 1e9,
                }
            )
if args.json:
    meta = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
    with open(args.json, "x") as f:
        json.dump({**meta, "jax": jax.__version__, "peak_gbs": args.peak_gbs, "rows": rows}, f)
