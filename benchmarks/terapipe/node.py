"""One stage of the two-stage TeraPipe benchmark (started by `run.py`).

Runs `TokenPipeline.value_and_grad` of the GPT for each slicing given in
--slicings (JSON list of lists) on a 2-device `stage` mesh, one device per
process, and prints on process 0 one `RESULT {json}` line per slicing with the
median step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slicings", required=True, help="JSON list of slicings")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    from zpp_jax.distributed import initialize

    initialize()
    import jax
    import numpy as np
    from flax import nnx

    from zpp_jax.models.gpt import GPT, GPTConfig
    from zpp_jax.pipeline import TokenPipeline

    cfg = GPTConfig(
        seq_len=args.seq,
        d_model=args.hidden,
        n_layers=args.layers,
        n_heads=args.heads,
        d_ff=4 * args.hidden,
        dtype="float32",
    )
    model = GPT(cfg, nnx.Rngs(0))
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices), ("stage",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (1, args.seq)).astype(np.int32)
    targets = rng.integers(0, 256, (1, args.seq)).astype(np.int32)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tok = jax.make_array_from_callback(tokens.shape, rep, lambda i: tokens[i])
    tgt = jax.make_array_from_callback(targets.shape, rep, lambda i: targets[i])
    runs = []
    for slices in json.loads(args.slicings):
        pipe = TokenPipeline(model, mesh, slices)
        params = pipe.params()
        start = time.perf_counter()
        compiled = pipe.value_and_grad.lower(params, tok, tgt).compile()
        compile_s = time.perf_counter() - start
        jax.block_until_ready(compiled(params, tok, tgt))
        runs.append((slices, compiled, params, compile_s, []))
    # Round robin, so that drift on the machine hits every slicing alike.
    for _ in range(args.steps):
        for _, compiled, params, _, times in runs:
            start = time.perf_counter()
            loss, _ = compiled(params, tok, tgt)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
    if jax.process_index() == 0:
        for slices, _, _, compile_s, times in runs:
            rec = dict(
                slices=slices, median_s=statistics.median(times), times_s=times, compile_s=compile_s
            )
            print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
