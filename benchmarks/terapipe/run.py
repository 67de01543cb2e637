"""A real two-stage TeraPipe pipeline on this machine, planned from a profile.

    python benchmarks/terapipe/run.py                 # GPT d=256, 4 layers, 2048 tokens

1. Profiles one stage (layers/2 blocks + LM head, forward and backward) in a
   process pinned to one core with one CPU device (`zpp profile`), over slice
   lengths x contexts, and fits the cost model.
2. Calibrates the runtime's per-step overhead (activation transfers, the
   stages waiting for each other), which one stage alone does not show: runs
   the real pipeline once on a calibration slicing of `granularity`-token
   slices (the most steps any plan can have) and sets `step_overhead` so
   that the model predicts that run (`calibrate_step_overhead`).
3. Plans with the lockstep objective (what the runtime executes): the
   planner's slicing, the best uniform slicing, and no slicing.
4. Runs the pipeline for each slicing: two `jax.distributed` processes, each
   pinned to its own core (`taskset`) with one CPU device, a `stage` mesh
   across them, a batch of one sequence; median step time (forward +
   backward) next to the predicted latency. These runs are separate from
   the calibration run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZPP_", "JAX_", "XLA_"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra or {})
    return env


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--granularity", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cost", default="/tmp/zpp_terapipe_cost.json")
    p.add_argument("--reuse-profile", action="store_true")
    args = p.parse_args(argv)

    from zpp_jax.pipeline import (
        best_uniform,
        calibrate_step_overhead,
        latency,
        load_cost,
        plan_tokens,
        save_cost,
    )

    per_stage = args.layers // 2
    if not (args.reuse_profile and pathlib.Path(args.cost).exists()):
        lengths = [n for n in (64, 128, 256, 512, 1024, 2048) if n <= args.seq]
        contexts = [c for c in (0, 512, 1024, 1536) if c < args.seq]

        def profile(core, out):
            cmd = ["taskset", "-c", str(core), sys.executable, "-m", "zpp_jax", "profile"]
            cmd += ["--layers", str(per_stage), "--hidden", str(args.hidden)]
            cmd += ["--heads", str(args.heads), "--seq", str(args.seq), "--out", out]
            cmd += ["--lengths", *map(str, lengths), "--contexts", *map(str, contexts)]
            quiet = subprocess.DEVNULL if core else None
            env = _env({"ZPP_LOCAL_CPU_DEVICES": "1"})
            return subprocess.Popen(cmd, env=env, stdout=quiet)

        # Both cores profile at once, as both stages will run at once (they
        # share the memory system); core 0's measurements are used.
        runs = [profile(0, args.cost), profile(1, args.cost + ".core1")]
        if any(r.wait() for r in runs):
            sys.exit("profiling failed")
    cost = load_cost(args.cost)
    g = args.granularity
    if args.seq % g:
        sys.exit(f"--seq {args.seq} is not a multiple of --granularity {g}")
    calibration = tuple([g] * (args.seq // g))
    (rec,) = _run_pipeline(args, [calibration])
    cost = calibrate_step_overhead(cost, calibration, 2, rec["median_s"])
    save_cost(cost, args.cost)
    bare = latency(
        calibration, dataclasses.replace(cost, step_overhead=0.0), 2, objective="lockstep"
    )
    print(
        f"calibration   {len(calibration):3d} x {g}: measured {rec['median_s']:.3f} s, "
        f"stage model alone {bare:.3f} s -> step overhead {cost.step_overhead * 1e3:.1f} ms",
        flush=True,
    )
    plans = {
        "no slicing": (args.seq,),
        "best uniform": best_uniform(args.seq, 2, cost, g, objective="lockstep").slices,
        "planner": plan_tokens(args.seq, 2, cost, g, objective="lockstep").slices,
    }
    predicted = {k: latency(s, cost, 2, objective="lockstep") for k, s in plans.items()}
    for k, s in plans.items():
        print(f"{k:13s} {len(s):3d} slices {list(s)}  predicted {predicted[k]:.3f} s", flush=True)
    measured = _run_pipeline(args, list(plans.values()))
    base = measured[0]["median_s"]
    print(
        "| slicing | slices | predicted | measured | measured / predicted | speedup vs no slicing |"
    )
    print("|---|---|---|---|---|---|")
    for (name, s), rec in zip(plans.items(), measured, strict=True):
        print(
            f"| {name} | {len(s)}: {_runs(s)} | {predicted[name]:.3f} s | {rec['median_s']:.3f} s"
            f" | {rec['median_s'] / predicted[name]:.2f} | {base / rec['median_s']:.2f}x |"
        )


def _run_pipeline(args, slicings) -> list[dict]:
    """Median step times of the two-process pipeline, one record per slicing."""
    from zpp_jax.launch import free_port, process_env

    port = free_port()
    procs = []
    for i in range(2):
        env = process_env(i, 2, 1, f"127.0.0.1:{port}", heartbeat_timeout=30, base=_env())
        cmd = ["taskset", "-c", str(i), sys.executable, str(HERE / "node.py")]
        cmd += ["--slicings", json.dumps([list(s) for s in slicings])]
        for flag in ("hidden", "heads", "layers", "seq", "steps"):
            cmd += [f"--{flag}", str(getattr(args, flag))]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    try:
        out = procs[0].communicate(timeout=3600)[0]
        procs[1].wait(timeout=120)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    if procs[0].returncode:
        sys.exit(f"the pipeline processes failed ({procs[0].returncode})")
    return [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]


def _runs(s):
    from zpp_jax.cli.plan import folded as _runs

    return _runs(s)


if __name__ == "__main__":
    main()
