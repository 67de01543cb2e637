"""The checks to run when an NVIDIA GPU is at hand (one H100 or H200 is
enough), in one script that finishes in a few minutes on the machine's own
JAX (the lent machine has jax 0.11.2 with CUDA 13; what else it lacks
travels as wheels, `benchmarks/gpu/wheels.py`):

1. kernels: every Pallas kernel (quantize, dequantize, the fused
   dequantize-sum-quantize, the reordered quantize, the dequantization of
   runs of tensors, from blocks and from a gathered wire whose rows it reads
   in the other order, with a last tile the tile size does not fill;
   int8 and int4, nearest
   and stochastic rounding) against the plain-JAX reference, bit for bit
   (codes and scales), on random and on adversarial blocks (zeros, Inf, NaN);
2. bandwidth: each kernel's bytes read plus written over its median time
   (`benchmarks/quant_kernels.py`);
3. steps: one GPU's training step of the same GPT and batch for plain
   `jax.jit` (`zpp.JitFSDP` on the one device), ZeRO-3 (bf16 wire), ZeRO++
   and ZeRO++ with error feedback, side by side, each the median of
   ``--steps`` timed steps. On a 1 x 1 mesh no collective runs, so the
   differences are what the engine's own work costs (ZeRO++'s quantization
   kernels above all);
4. estimate: XLA's estimate of each of those steps (its latency-hiding
   scheduler's cost model over the schedule it made,
   `zpp_jax.analysis.report.compile_with_estimate`) beside the measured
   time: the ratio calibrates the compile-only estimates of the H200 pages.

Each part runs even when an earlier one fails (its error is printed and
recorded), so one call of a short-lived GPU machine returns everything it
can. With ``--json DIR`` it writes ``gpu.json`` and ``kernels.json`` there,
then the results page from them (`benchmarks/gpu/report.py`).
``--allow-cpu`` runs everything but the GPU (the kernels then run their
reference and XLA makes no estimate): the dry run the tests make.

    python benchmarks/gpu/run.py [--model 125m] [--json DIR]
"""

import argparse
import importlib.metadata
import itertools
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
from zpp_jax.analysis.report import compile_with_estimate
from zpp_jax.models import GPT, GPTConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import pages  # noqa: E402  (benchmarks/pages.py: what every results page states)

PARTS = ("kernels", "bandwidth", "steps")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="H200: 4800, H100: 3350")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default="125m", help="GPT preset of the step timings")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--allow-cpu", action="store_true", help="the dry run, without a GPU")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--json", type=Path, default=None, help="a new directory for the page")
    return parser.parse_args(argv)


class Results:
    """What the parts measured, and each part's error."""

    def __init__(self) -> None:
        versions = {n: importlib.metadata.version(n) for n in ("jax", "jaxlib", "flax", "optax")}
        self.data = {
            "device": jax.devices()[0].device_kind,
            **versions,
            "command": pages.command(),
            "machine": pages.machine(),
            "errors": {},
        }

    def part(self, name, fn) -> None:
        """Run one part; on failure print and record the error and go on."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report every part's failure, run the rest
            traceback.print_exc()
            self.data["errors"][name] = f"{type(e).__name__}: {e}"[:2000]


# -- 1. kernels against the reference, bit for bit ----------------------------------


def adversarial(n, seed):
    x = np.asarray(jax.random.normal(jax.random.key(seed), (n,), jnp.float32)) * 3.0
    x[:256] = 0.0  # an all-zero block
    x[1000], x[2000], x[3000] = np.inf, -np.inf, np.nan
    return jnp.asarray(x)


def same(a, b):
    return all(
        np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


ROUNDINGS = ("nearest", "stochastic")


def kernel_cases(n, bits, rounding, nodes=2, local=4, block=256):
    """(name, Pallas function, reference function, inputs) for one setting."""
    ref, r = pk.reference, rounding
    x = adversarial(n, bits)
    q = jax.jit(lambda a: ref.quantize(a, bits, block))(x)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * local), q)
    residual = adversarial(n, bits + 1).reshape(local, nodes, -1) / 100
    nb = q.scales.shape[-1]
    runs = (nb // 4, nb // 4, nb - 2 * (nb // 4))  # three tensors back to back
    wire = gathered_wire(q, nodes, local)
    return [
        ("quantize", lambda a: pk.quantize(a, bits, block, rounding=r),
         lambda a: ref.quantize(a, bits, block, rounding=r), (x,)),
        ("quantize_reordered",
         lambda a: pk.quantize_reordered(a, nodes, local, bits, block, rounding=r),
         lambda a: ref.quantize_reordered(a, nodes, local, bits, block, rounding=r), (x,)),
        ("quantize_reordered_with_feedback",
         lambda a, e: pk.quantize_reordered_with_feedback(
             a, e, nodes, local, bits, block, rounding=r),
         lambda a, e: ref.quantize_reordered_with_feedback(
             a, e, nodes, local, bits, block, rounding=r), (x, residual)),
        ("dequantize", lambda c: pk.dequantize(c, bits, n),
         lambda c: ref.dequantize(c, bits, n), (q,)),
        ("dequantize_sum_quantize", lambda c: pk.dequantize_sum_quantize(c, bits, n, rounding=r),
         lambda c: ref.dequantize_sum_quantize(c, bits, n, None, rounding=r), (stacked,)),
        ("dequantize_runs", lambda c: pk.dequantize_runs(c, bits, runs),
         lambda c: ref.dequantize_runs(c, bits, runs), (q,)),
        ("dequantize_runs, a gathered wire",
         lambda w: pk.dequantize_runs(w, bits, runs, block=block, swap_lead=True),
         lambda w: ref.dequantize_runs(w, bits, runs, block=block, swap_lead=True), (wire,)),
    ]  # fmt: skip


def gathered_wire(q, nodes, local):
    """`q` as a gathered hpZ wire: rows (local, nodes) of bytes, each a
    different rotation of the blocks, then their scales' bytes."""
    rows = [jax.tree.map(lambda a, i=i: jnp.roll(a, i, axis=0), q) for i in range(nodes * local)]
    codes = jnp.stack([jax.lax.bitcast_convert_type(x.codes, jnp.uint8).reshape(-1) for x in rows])
    scales = jnp.stack([x.scales for x in rows])
    tail = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(len(rows), -1)
    wire = jnp.concatenate([codes, tail], axis=1).reshape(local, nodes, -1)
    return pk.QuantizedBlocks(wire, scales.reshape(local, nodes, -1))


def check_kernels(results, n):
    """Every kernel at `n` elements, and at 3 blocks more, which leaves the
    last tile of rows part empty (masked, not padded)."""
    rows = results.data["kernels"] = []
    for size, bits, rounding in itertools.product((n, n + 3 * 256), (8, 4), ROUNDINGS):
        for name, kernel, reference, xs in kernel_cases(size, bits, rounding):
            ok = same(jax.jit(kernel)(*xs), jax.jit(reference)(*xs))
            row = {"op": name, "size": size, "bits": bits, "rounding": rounding}
            rows.append({**row, "bit_identical": ok})
            verdict = "bit-identical" if ok else "DIFFERS"
            print(f"  {name:34s} {size:9d} int{bits} {rounding:10s} {verdict}")
    failures = sum(not k["bit_identical"] for k in rows)
    print(f"kernels: {'all bit-identical' if not failures else f'{failures} differ'}")


# -- 2. kernel bandwidth -------------------------------------------------------------


def bandwidth(args):
    mib = ["1"] if args.allow_cpu else ["256", "1024"]
    out = ["--json", str(args.json / "kernels.json")] if args.json else []
    command = [sys.executable, str(HERE.parent / "quant_kernels.py"), "--mib", *mib]
    subprocess.run(command + ["--peak-gbs", str(args.peak_gbs), *out], check=True)


# -- 3 and 4. one training step per method on this GPU, and XLA's estimate of it ------


def programs(cfg):
    """(name, a training program on one device) per method, on the same model."""
    mesh = zpp.make_mesh(1, 1, devices=jax.devices()[:1])
    tx = optax.adamw(1e-3)
    engine = {
        "zero3 (bf16 wire)": zpp.ZeroPPConfig.zero3(comm_dtype="bfloat16"),
        "zeropp": zpp.ZeroPPConfig(comm_dtype="bfloat16"),
        "zeropp + error feedback": zpp.ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True),
    }
    yield "plain jax.jit", lambda: zpp.JitFSDP(GPT(cfg, nnx.Rngs(0)), tx, mesh)
    for name, config in engine.items():
        yield name, lambda config=config: zpp.Trainer(GPT(cfg, nnx.Rngs(0)), tx, mesh, config)


def measure_step(program, batch, steps):
    """(Median seconds of `steps` timed steps, XLA's estimate in seconds or
    None), of one compile of the program's step."""
    placed = jax.device_put(batch, program.batch_sharding())
    compiled, estimate = compile_with_estimate(program, placed)
    state, metrics = compiled(program.init(), placed)  # the first run: warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = compiled(state, placed)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    return statistics.median(times), None if estimate is None else estimate.step_us * 1e-6


def time_steps(results, args):
    cfg = GPTConfig.preset(args.model)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, cfg.seq_len + 1), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    measured, estimated = results.data["step_s"], results.data["estimate_s"]

    def one(name, build):
        measured[name], estimated[name] = measure_step(build(), batch, args.steps)

    for name, build in programs(cfg):
        results.part(name, lambda name=name, build=build: one(name, build))
    base = measured.get("plain jax.jit", float("nan"))
    print(f"\nGPT {args.model}, batch {args.batch} x {cfg.seq_len}, one device, median of "
          f"{args.steps} steps (XLA's estimate beside it):")  # fmt: skip
    for name, t in measured.items():
        guess = estimated.get(name)
        beside = "no estimate" if guess is None else f"estimate {1e3 * guess:8.1f} ms"
        print(f"  {name:26s}{1e3 * t:9.1f} ms  {t / base:5.2f}x plain jit  {beside}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if jax.default_backend() != "gpu" and not args.allow_cpu:
        sys.exit(f"needs a GPU; jax sees {jax.default_backend()} (--allow-cpu: the dry run)")
    if args.json:
        args.json.mkdir(parents=True, exist_ok=False)  # a page is never overwritten
    results = Results()
    print(f"device: {results.data['device']}, jax {jax.__version__}")
    if "kernels" in args.parts:
        results.part("kernels", lambda: check_kernels(results, 1 << (14 if args.allow_cpu else 22)))
    if "bandwidth" in args.parts:
        results.part("bandwidth", lambda: bandwidth(args))
    results.data.update(model=args.model, batch=args.batch, step_s={}, estimate_s={})
    if "steps" in args.parts:
        time_steps(results, args)
    if args.json:
        (args.json / "gpu.json").write_text(json.dumps(results.data, indent=1))
        if (args.json / "kernels.json").exists():
            subprocess.run([sys.executable, str(HERE / "report.py"), str(args.json)], check=True)
    kernels = results.data.get("kernels", [])
    return 1 if results.data["errors"] or not all(k["bit_identical"] for k in kernels) else 0


if __name__ == "__main__":
    sys.exit(main())
