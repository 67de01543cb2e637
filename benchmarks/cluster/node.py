"""One node of the two-node benchmark (started by `run.py`, one per namespace).

Times the GPT training step of each method on the (node, local) mesh with
node = process and prints, on process 0, one JSON line per method and rate:
{"method", "rate", "median_s", "times_s", "link_tx_bytes", "link_rx_bytes",
...}. Each method is compiled once; for each of `--rates` every node shapes
its own end of the link (`shaping.shape`), the nodes meet at a barrier, and the
step is warmed up and timed. The link bytes are read from this namespace's
veth counters around the timed steps, so they are what really crossed the
shaped link, per step.

Methods:
- `zero3`: this library with every technique off (bf16 gathers and bf16
  gradient reduction);
- `zeropp`: qwZ (int8 weights) + hpZ + qgZ (int4 gradients);
- `jit`: what a JAX user would otherwise write: the unsharded NNX model's
  loss under `jax.jit`, parameters and optimizer state laid out with
  `NamedSharding` (FSDP-style: each tensor's largest divisible axis over all
  devices) and XLA's SPMD partitioner inserting the collectives;
- `jit_fsdp`: the same with every layer's activations constrained to the
  batch axes (`JitFSDP(constrain_activations=True)`), as FSDP is written
  with MaxText's rules: XLA gathers the weights instead of resharding
  activations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

import numpy as np


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=["zero3", "zeropp", "jit", "jit_fsdp"])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="compute dtype of the model")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=9, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--link", default=None, help="network interface to count bytes on")
    p.add_argument(
        "--rates",
        nargs="+",
        default=[None],
        help="shape --link to each rate in turn (tc syntax, or 'unshaped'); default: leave it",
    )
    p.add_argument("--tag", default="", help="copied into every output record")
    p.add_argument(
        "--burst-ms",
        type=float,
        default=1.0,
        help="tbf bucket of the shaped link, in milliseconds of its rate (see shaping.py)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="NODESxLOCAL, e.g. 2x4 for one process with 8 devices (default: one node per process)",
    )
    return p.parse_args(argv)


def _link_bytes(link):
    if not link:
        return 0, 0
    base = pathlib.Path("/sys/class/net") / link / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def _zpp_step(method, model_cfg, mesh, seed):
    import optax
    from flax import nnx

    from zpp_jax import Trainer, ZeroPPConfig
    from zpp_jax.models import GPT

    config = ZeroPPConfig.zero3() if method == "zero3" else ZeroPPConfig(comm_dtype="bfloat16")
    model = GPT(model_cfg, nnx.Rngs(seed))
    size = _num_params(model)
    trainer = Trainer(model, optax.adamw(1e-3), mesh, config)
    return trainer.train_step, trainer.init(), trainer.batch_sharding(), size


def _jit_step(model_cfg, mesh, seed, constrain: bool):
    """A plain-jit baseline (`zpp_jax.baseline.JitFSDP`): no library code in
    the step; `constrain`: activations constrained to the batch axes."""
    import optax
    from flax import nnx

    from zpp_jax.baseline import JitFSDP
    from zpp_jax.models import GPT

    model = GPT(model_cfg, nnx.Rngs(seed))
    size = _num_params(model)
    baseline = JitFSDP(model, optax.adamw(1e-3), mesh, constrain_activations=constrain)
    return baseline.train_step, baseline.init(), baseline.batch_sharding(), size


def _num_params(model) -> int:
    """Parameters of the model a method really trains (not of the flags)."""
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _timed_step(compiled, state, batch):
    """(The new state, the seconds one step took, its loss), the batch on
    its devices before the clock starts."""
    import jax

    jax.block_until_ready(batch)
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    loss = float(metrics["loss"])
    return state, time.perf_counter() - start, loss


def main(argv=None) -> None:
    args = _parse(argv)
    from zpp_jax.distributed import initialize, node_mesh

    initialize()
    import jax
    import shaping
    from jax.experimental import multihost_utils

    from zpp_jax.data import TokenDataset, host_to_global, stdlib_corpus
    from zpp_jax.models.gpt import GPTConfig

    if args.mesh is None:
        mesh = node_mesh()
    else:
        from zpp_jax import make_mesh

        nodes, local = (int(n) for n in args.mesh.lower().split("x"))
        mesh = make_mesh(nodes, local)
    model_cfg = GPTConfig(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        d_ff=args.d_ff,
        seq_len=args.seq,
        dtype=args.dtype,
    )
    data = TokenDataset(stdlib_corpus(4 << 20), args.seq)
    lead = jax.process_index() == 0

    for method in args.methods:
        if method in ("jit", "jit_fsdp"):
            step, state, sharding, size = _jit_step(model_cfg, mesh, 0, method == "jit_fsdp")
        else:
            step, state, sharding, size = _zpp_step(method, model_cfg, mesh, 0)

        def batch(i, sharding=sharding):
            return host_to_global(data.batch("train", i, args.batch, 0), sharding)

        start = time.perf_counter()
        compiled = step.lower(state, batch(0)).compile()
        compile_s = time.perf_counter() - start
        i = 0
        for k, rate in enumerate(args.rates):
            if rate is not None:
                shaping.shape(args.link, rate, args.burst_ms)
                multihost_utils.sync_global_devices(f"{method} {rate}")
            # The first steps after compiling also grow the heap and fault
            # pages in: two more warm-up steps before the first rate.
            for _ in range(args.warmup + (2 if k == 0 else 0)):
                state, metrics = compiled(state, batch(i))
                jax.block_until_ready(metrics)
                i += 1
            times, losses, (tx0, rx0) = [], [], _link_bytes(args.link)
            for _ in range(args.steps):
                state, seconds, loss = _timed_step(compiled, state, batch(i))
                times.append(seconds)
                losses.append(loss)
                i += 1
            tx1, rx1 = _link_bytes(args.link)
            record = dict(
                method=method,
                rate=rate,
                tag=args.tag,
                median_s=statistics.median(times),
                times_s=times,
                losses=losses,
                compile_s=compile_s,
                link_tx_bytes=(tx1 - tx0) / args.steps,
                link_rx_bytes=(rx1 - rx0) / args.steps,
                params=size,
                tokens_per_device=args.batch * args.seq // mesh.size,
                model=dataclasses.asdict(model_cfg),
            )
            if lead:
                print("RESULT " + json.dumps(record), flush=True)
        del state, compiled
    sys.stdout.flush()


if __name__ == "__main__":
    np.set_printoptions(linewidth=120)
    main()
