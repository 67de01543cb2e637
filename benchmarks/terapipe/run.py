"""TeraPipe's training mode on this machine: `zpp train --stages 2`, planned
from a profile and a measured link, with no calibration run of the pipeline.

    python benchmarks/terapipe/run.py --out DIR   # GPT `small` (d 256, 4 layers), 2048 tokens

1. Profiles one stage (layers/2 blocks + LM head, forward and backward) in a
   process pinned to one core with one CPU device (`zpp profile`), over slice
   lengths x contexts, and fits the compute model. Both cores profile at
   once, as both stages will run at once.
2. Measures the stage-to-stage link (`zpp profile --link`): point-to-point
   transfers between two processes, fitted as latency + bytes / bandwidth.
3. Plans with `LinkCost(compute, link)` and the lockstep objective (what
   the runtime executes): the planner's slicing, the best uniform slicing,
   and no slicing.
4. Trains with each slicing: `zpp train --stages 2` as two `jax.distributed`
   processes, each pinned to its own core with one CPU device (one stage
   each), a batch of one sequence, fp32, the layers replicated in their
   stage; median step time over the steps after the first, next to the
   prediction.

Writes `terapipe.json`, `terapipe.png` and `report.md` in --out.

    python benchmarks/terapipe/run.py --out docs/results/DATE-terapipe
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import pages  # noqa: E402


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZPP_", "JAX_", "XLA_"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra or {})
    return env


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--model", default="small", help="zpp train's GPT preset")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--granularity", type=int, default=64)
    p.add_argument("--steps", type=int, default=6, help="training steps per slicing")
    p.add_argument("--cost", default="/tmp/zpp_terapipe_cost.json")
    p.add_argument("--link", default="/tmp/zpp_terapipe_link.json")
    p.add_argument("--reuse-profile", action="store_true")
    args = p.parse_args(argv)
    pages.prepare(args.out, "terapipe", args.overwrite)

    from zpp_jax.models.gpt import GPTConfig
    from zpp_jax.pipeline import best_uniform, latency, load_cost, plan_tokens
    from zpp_jax.pipeline.cost import LinkCost

    model = GPTConfig.preset(args.model, seq_len=args.seq)
    per_stage = model.n_layers // 2
    if not (args.reuse_profile and pathlib.Path(args.cost).exists()):
        _profile(args, model, per_stage)
    link = json.loads(pathlib.Path(args.link).read_text())
    cost = LinkCost(load_cost(args.cost), model.d_model, link["bytes_per_s"], link["latency_s"], 4)
    print(
        f"link: {link['bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, {link['latency_s'] * 1e6:.0f} us; "
        f"a {args.granularity}-token slice's transfers "
        f"{cost.transfer(1, args.granularity) * 1e3:.2f} ms",
        flush=True,
    )
    g = args.granularity
    plans = {
        "no slicing": (args.seq,),
        "best uniform": best_uniform(args.seq, 2, cost, g, objective="lockstep").slices,
        "planner": plan_tokens(args.seq, 2, cost, g, objective="lockstep").slices,
    }
    predicted = {k: latency(s, cost, 2, objective="lockstep") for k, s in plans.items()}
    for k, s in plans.items():
        print(f"{k:13s} {len(s):3d} slices {_runs(s)}  predicted {predicted[k]:.3f} s", flush=True)
    measured = {k: _train(args, s) for k, s in plans.items()}
    result = {
        "command": pages.command(),
        "machine": pages.machine(),
        "model": args.model,
        "seq": args.seq,
        "granularity": g,
        "steps": args.steps,
        "link": link,
        "plans": {
            k: {"slices": list(s), "predicted_s": predicted[k], "measured_s": measured[k]}
            for k, s in plans.items()
        },
    }
    pages.write_json(args.out, "terapipe", result)
    _plot(result["plans"], args.out / "terapipe.png")
    pages.write_page(args.out, _page(result))


def _page(result: dict) -> str:
    plans = result["plans"]
    base = plans["no slicing"]["measured_s"]
    rows = [
        [
            name,
            f"{len(r['slices'])}: {_runs(r['slices'])}",
            f"{r['predicted_s']:.3f} s",
            f"{r['measured_s']:.3f} s",
            f"{r['measured_s'] / r['predicted_s']:.2f}",
            f"{base / r['measured_s']:.2f}x",
        ]
        for name, r in plans.items()
    ]
    header = ["slicing", "slices", "predicted", "measured (train step)", "measured / predicted"]
    link = result["link"]
    return (
        "# TeraPipe: the training mode against its prediction\n\n"
        f"Made by `{result['command']}`. {pages.machine_line(result['machine'])}\n\n"
        "`zpp train --stages 2` itself: two `jax.distributed` processes, each pinned to its "
        f"own core with one CPU device (one stage each), GPT `{result['model']}` on one "
        f"sequence of {result['seq']} tokens, fp32; median train step (forward, backward, "
        f"optimizer) over the {result['steps'] - 1} steps after the first. The prediction uses "
        "no run of the pipeline: the stage's compute from `zpp profile` (both cores "
        "profiling at once, as both stages run at once) plus the link measured by "
        f"`zpp profile --link` ({link['bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, "
        f"{link['latency_s'] * 1e6:.0f} us between the two pinned processes), planned with "
        f"the lockstep objective at granularity {result['granularity']}. What the stage "
        "profile does not time (the optimizer update, the embedding) is the gap between the "
        "two. Data: [terapipe.json](terapipe.json).\n\n"
        + pages.table([*header, "speedup vs no slicing"], rows)
        + "\n\n![predicted and measured](terapipe.png)\n"
    )


def _plot(plans: dict, path: pathlib.Path) -> None:
    fig, ax = pages.figure(figsize=(6, 3.5))
    names = list(plans)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [plans[n]["predicted_s"] for n in names], 0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], [plans[n]["measured_s"] for n in names], 0.4, label="measured")
    ax.set_xticks(list(x), [f"{n}\n{len(plans[n]['slices'])} slices" for n in names])
    ax.set_ylabel("train step, s")
    ax.set_title("zpp train --stages 2: the planner's prediction and the step", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    pages.save(fig, path)


def _profile(args, model, per_stage) -> None:
    lengths = [n for n in (64, 128, 256, 512, 1024, 2048) if n <= args.seq]
    contexts = [c for c in (0, 512, 1024, 1536) if c < args.seq]

    def profile(core, out):
        cmd = ["taskset", "-c", str(core), sys.executable, "-m", "zpp_jax", "profile"]
        cmd += ["--layers", str(per_stage), "--hidden", str(model.d_model)]
        cmd += ["--heads", str(model.n_heads), "--ffn", str(model.d_ff)]
        # Every length at every context: the stage's positions must reach
        # the longest length after the longest context.
        cmd += ["--seq", str(max(lengths) + max(contexts)), "--out", out]
        cmd += ["--lengths", *map(str, lengths), "--contexts", *map(str, contexts)]
        quiet = subprocess.DEVNULL if core else None
        return subprocess.Popen(cmd, env=_env({"ZPP_LOCAL_CPU_DEVICES": "1"}), stdout=quiet)

    runs = [profile(0, args.cost), profile(1, args.cost + ".core1")]
    if any(r.wait() for r in runs):
        sys.exit("profiling failed")
    # The link between the two pinned processes the stages will be.
    cmd = ["taskset", "-c", "0,1", sys.executable, "-m", "zpp_jax", "profile", "--link"]
    if subprocess.run([*cmd, "--out", args.link], env=_env()).returncode:
        sys.exit("measuring the link failed")


def _train(args, slices) -> float:
    """Median step time of `zpp train --stages 2` with `slices`, two pinned
    processes, over the steps after the first."""
    from zpp_jax.launch import free_port, process_env

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = pathlib.Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "zpp_jax", "train", "--quiet", "--stages", "2"]
        cmd += ["--model", args.model, "--seq", str(args.seq), "--batch", "1"]
        cmd += ["--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "1"]
        cmd += ["--compute-dtype", "float32", "--no-stage-zero", "--metrics", str(metrics)]
        # A lone number is a slice count: one slice of the whole sequence is "1".
        cmd += ["--slices", ",".join(map(str, slices)) if len(slices) > 1 else "1"]
        procs = [
            subprocess.Popen(
                ["taskset", "-c", str(i), *cmd],
                env=process_env(i, 2, 1, f"127.0.0.1:{port}", heartbeat_timeout=30, base=_env()),
            )
            for i in range(2)
        ]
        try:
            codes = [q.wait(timeout=3600) for q in procs]
        finally:
            for q in procs:
                if q.poll() is None:
                    q.kill()
        if any(codes):
            sys.exit(f"zpp train --stages 2 failed ({codes})")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    tokens = args.seq  # one sequence per step
    return statistics.median(tokens / r["tokens_per_s"] for r in records[1:])


def _runs(s):
    from zpp_jax.pipeline.planner import folded

    return folded(s)


if __name__ == "__main__":
    main()
