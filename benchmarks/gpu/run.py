"""The checks to run when an NVIDIA GPU is at hand (one H200 is enough), in
one script that finishes in a few minutes:

1. kernels: every Pallas kernel (quantize, dequantize, the fused
   dequantize-sum-quantize, the reordered quantize; int8 and int4, nearest
   and stochastic rounding) against the plain-JAX reference, bit for bit
   (codes and scales), on random and on adversarial blocks (zeros, Inf, NaN);
2. bandwidth: each kernel's bytes read plus written over its median time, as
   a share of the GPU's memory bandwidth (`benchmarks/quant_kernels.py`);
3. steps: the median time of one training step of GPT 125m on this GPU
   (a 1 x 1 mesh: no collective runs, so this is each method's compute and
   quantization cost) for plain `jax.jit`, ZeRO-3 (bf16 wire), ZeRO++ and
   ZeRO++ with error feedback, side by side.

Each part runs even when an earlier one fails (its error is printed and
recorded), so one call of a short-lived GPU machine returns everything it
can. With `--json DIR`, the results are also written as JSON files there
(`gpu.json`, `kernels.json`) for the results pages.

    python benchmarks/gpu/run.py [--peak-gbs 4800] [--json DIR]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pallas_kernels as pk
import zpp_jax as zpp
from zpp_jax.models import GPT, GPTConfig

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--peak-gbs", type=float, default=4800.0, help="H200: 4800")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--model", default="125m", help="GPT preset of the step timings")
parser.add_argument(
    "--allow-cpu",
    action="store_true",
    help="run without a GPU, to check the script itself (the kernels then run their reference)",
)
parser.add_argument(
    "--parts",
    nargs="+",
    default=["kernels", "bandwidth", "steps"],
    choices=["kernels", "bandwidth", "steps"],
)
parser.add_argument(
    "--no-unroll",
    action="store_true",
    help="step the layers as a loop (ZeroPPConfig.unroll_layer_loops=False): the JAX "
    "versions outside the declared range cannot rewrite loops",
)
parser.add_argument("--json", default=None, help="a directory for gpu.json and kernels.json")
args = parser.parse_args()
if jax.default_backend() != "gpu" and not args.allow_cpu:
    sys.exit(f"needs a GPU; jax sees {jax.default_backend()}")
print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "errors": {}}


def part(name, fn):
    """Run one part; on failure print and record the error and go on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report every part's failure, run the rest
        traceback.print_exc()
        results["errors"][name] = f"{type(e).__name__}: {e}"[:2000]


# -- 1. kernels against the reference, bit for bit ----------------------------------


def inputs(n, seed):
    x = np.asarray(jax.random.normal(jax.random.key(seed), (n,), jnp.float32)) * 3.0
    x[:256] = 0.0  # an all-zero block
    x[1000], x[2000], x[3000] = np.inf, -np.inf, np.nan
    return jnp.asarray(x)


def same(a, b):
    return all(
        np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


ref = pk.reference
N, NODES, LOCAL, BLOCK = (1 << 22) if not args.allow_cpu else (1 << 14), 2, 4, 256


def kernel_cases(bits, rounding):
    """(name, Pallas function, reference function, inputs) for one setting."""
    x = inputs(N, bits)
    q = jax.jit(lambda a: ref.quantize(a, bits, BLOCK))(x)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * LOCAL), q)
    residual = inputs(N, bits + 1).reshape(LOCAL, NODES, -1) / 100
    return [
        (
            "quantize",
            lambda a: pk.quantize(a, bits, BLOCK, rounding=rounding),
            lambda a: ref.quantize(a, bits, BLOCK, rounding=rounding),
            (x,),
        ),
        (
            "quantize_reordered",
            lambda a: pk.quantize_reordered(a, NODES, LOCAL, bits, BLOCK, rounding=rounding),
            lambda a: ref.quantize_reordered(a, NODES, LOCAL, bits, BLOCK, rounding=rounding),
            (x,),
        ),
        (
            "quantize_reordered_with_feedback",
            lambda a, r: pk.quantize_reordered_with_feedback(
                a, r, NODES, LOCAL, bits, BLOCK, rounding=rounding
            ),
            lambda a, r: ref.quantize_reordered_with_feedback(
                a, r, NODES, LOCAL, bits, BLOCK, rounding=rounding
            ),
            (x, residual),
        ),
        (
            "dequantize",
            lambda q: pk.dequantize(q, bits, N),
            lambda q: ref.dequantize(q, bits, N),
            (q,),
        ),
        (
            "dequantize_sum_quantize",
            lambda q: pk.dequantize_sum_quantize(q, bits, N, rounding=rounding),
            lambda q: ref.dequantize_sum_quantize(q, bits, N, None, rounding=rounding),
            (stacked,),
        ),
    ]


def check_kernels():
    results["kernels"] = []
    for bits in (8, 4):
        for rounding in ("nearest", "stochastic"):
            for name, kernel, reference, xs in kernel_cases(bits, rounding):
                ok = same(jax.jit(kernel)(*xs), jax.jit(reference)(*xs))
                results["kernels"].append(
                    {"op": name, "bits": bits, "rounding": rounding, "bit_identical": ok}
                )
                print(
                    f"  {name:34s} int{bits} {rounding:10s} {'bit-identical' if ok else 'DIFFERS'}"
                )
    failures = sum(not k["bit_identical"] for k in results["kernels"])
    print(f"kernels: {'all bit-identical' if not failures else f'{failures} differ'}")


if "kernels" in args.parts:
    part("kernels", check_kernels)

# -- 2. kernel bandwidth -------------------------------------------------------------

here = Path(__file__).resolve().parents[1]
mib = ["1"] if args.allow_cpu else ["256", "1024"]
out = ["--json", str(Path(args.json) / "kernels.json")] if args.json else []
if "bandwidth" in args.parts:
    part(
        "bandwidth",
        lambda: subprocess.run(
            [sys.executable, str(here / "quant_kernels.py"), "--mib", *mib]
            + ["--peak-gbs", str(args.peak_gbs), *out],
            check=True,
        ),
    )

# -- 3. one training step per method, on this GPU ------------------------------------

cfg = GPTConfig.preset(args.model)
tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def median_time(step, state, batch):
    state, _ = step(state, batch)  # compile
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def plain_jit():
    model = GPT(cfg, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(zpp.train.next_token_loss)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    return median_time(step, state, batch)


mesh = zpp.make_mesh(1, 1)
loops = {"unroll_layer_loops": not args.no_unroll}
methods = {
    "zero3 (bf16 wire)": zpp.ZeroPPConfig.zero3(comm_dtype="bfloat16", **loops),
    "zeropp": zpp.ZeroPPConfig(comm_dtype="bfloat16", **loops),
    "zeropp + error feedback": zpp.ZeroPPConfig(
        comm_dtype="bfloat16", error_feedback=True, **loops
    ),
}
results["unroll_layer_loops"] = loops["unroll_layer_loops"]
times = results["step_s"] = {}


def engine_step(config):
    trainer = zpp.Trainer(GPT(cfg, nnx.Rngs(0)), optax.adamw(1e-3), mesh, config)
    placed = jax.device_put(batch, trainer.batch_sharding())
    return median_time(trainer.train_step, trainer.init(), placed)


if "steps" in args.parts:
    part("plain jax.jit", lambda: times.__setitem__("plain jax.jit", plain_jit()))
    for name, config in methods.items():
        part(name, lambda name=name, config=config: times.__setitem__(name, engine_step(config)))
base = times.get("plain jax.jit", float("nan"))
print(f"\nGPT {args.model}, batch 8 x {cfg.seq_len}, one GPU, median of {args.steps} steps:")
for name, t in times.items():
    print(f"  {name:26s}{1e3 * t:9.1f} ms  {t / base:5.2f}x plain jit")
results["model"], results["batch"], results["seq_len"] = args.model, 8, cfg.seq_len
if args.json:
    with open(Path(args.json) / "gpu.json", "x") as f:
        json.dump(results, f, indent=1)
failed = results["errors"] or not all(k["bit_identical"] for k in results.get("kernels", []))
sys.exit(1 if failed else 0)
