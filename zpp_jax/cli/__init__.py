"""The `zpp` command (also `python -m zpp_jax`): the parser, the error
handling, and one module per subcommand (`train`, `comm`, `demo`, `plan`,
`profile`; `launch` is `zpp_jax.launch`)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import signal
import sys
import threading
import time

from zpp_jax import config as _config
from zpp_jax.cli.args import RUN, Parser
from zpp_jax.errors import Number, UsageError, count, positive
from zpp_jax.launch import RANGES as LAUNCH

# ZeroPPConfig's bound on a block.
BLOCK = count(1, _config._MAX_BLOCK, "elements per block")


def _add_technique_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ZeRO++ techniques (all on by default)")
    g.add_argument(
        "--zero3",
        action="store_true",
        help="the ZeRO-3 baseline: every technique off, bf16 wire (ZeroPPConfig.zero3())",
    )
    # Defaults are None so that a flag given with --zero3 can be told from
    # one left alone; ZeroPPConfig holds the real defaults.
    g.add_argument("--no-qwz", action="store_true", default=None, help="gather weights unquantized")
    g.add_argument("--no-hpz", action="store_true", default=None, help="no secondary partition")
    g.add_argument(
        "--no-qgz", action="store_true", default=None, help="plain reduce-scatter of gradients"
    )
    g.add_argument(
        "--weight-bits", type=int, choices=_config._SUPPORTED_WEIGHT_BITS, help="default 8"
    )
    g.add_argument(
        "--gradient-bits", type=int, choices=_config._SUPPORTED_GRADIENT_BITS, help="default 4"
    )
    g.add_argument(
        "--error-feedback",
        action="store_true",
        default=None,
        help="carry gradient rounding errors",
    )
    g.add_argument("--block-size", type=BLOCK, help="elements per weight block (default 256)")
    g.add_argument(
        "--gradient-block-size", type=BLOCK, help="elements per gradient block (default 32)"
    )
    g.add_argument(
        "--gradient-scale-dtype",
        choices=_config._SUPPORTED_SCALE_DTYPES,
        help="dtype gradient scales travel in (default bfloat16)",
    )
    g.add_argument(
        "--gradient-rounding",
        choices=_config._SUPPORTED_ROUNDINGS,
        help="rounding of gradient codes (default stochastic: unbiased)",
    )
    g.add_argument(
        "--comm-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32", "float16"),
        help="wire dtype of the unquantized collectives (default bfloat16)",
    )
    p.add_argument(
        "--remat",
        choices=_config._SUPPORTED_REMATS,
        default=_config.ZeroPPConfig.remat,
        help="what a unit keeps for its backward pass (ZeroPPConfig.remat): its matmul outputs "
        "(dots, default), every activation (none) or only its input (full: one more forward "
        "pass); never its gathered weights",
    )


# flag -> (ZeroPPConfig field, value the flag sets)
_TECHNIQUE_FLAGS = {
    "no_qwz": ("quantize_weights", False),
    "no_hpz": ("hpz", False),
    "no_qgz": ("quantize_gradients", False),
    "weight_bits": ("weight_bits", None),
    "gradient_bits": ("gradient_bits", None),
    "error_feedback": ("error_feedback", True),
    "block_size": ("block_size", None),
    "gradient_block_size": ("gradient_block_size", None),
    "gradient_rounding": ("gradient_rounding", None),
    "gradient_scale_dtype": ("gradient_scale_dtype", None),
}


def _config_from_args(args):
    """The ZeroPPConfig the technique flags describe."""
    from zpp_jax.config import ZeroPPConfig

    given = {dest: getattr(args, dest) for dest in _TECHNIQUE_FLAGS}
    given = {dest: value for dest, value in given.items() if value is not None}
    if args.zero3:
        if given:
            flags = ", ".join("--" + dest.replace("_", "-") for dest in given)
            it = "them" if len(given) > 1 else "it"
            raise UsageError(
                f"--zero3 turns every ZeRO++ technique off, so {flags} would have no effect; "
                f"drop {it}, or drop --zero3 and switch techniques off one by one "
                "(--no-qwz, --no-hpz, --no-qgz)"
            )
        return ZeroPPConfig.zero3(comm_dtype=args.comm_dtype, remat=args.remat)
    fields = {}
    for dest, value in given.items():
        field, sets = _TECHNIQUE_FLAGS[dest]
        fields[field] = value if sets is None else sets
    return ZeroPPConfig(comm_dtype=args.comm_dtype, remat=args.remat, **fields)


def _use_emulated_devices(devices: int, what: str = "--nodes x --local") -> None:
    """Give the CPU backend `devices` devices unless the user chose a number.

    Must run before jax initializes its backends; only the CPU backend reads it.
    """
    from zpp_jax.distributed import check_cpu_devices

    check_cpu_devices(devices, what)
    if (
        "JAX_NUM_CPU_DEVICES" in os.environ
        or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    ):
        return
    import jax

    jax.config.update("jax_num_cpu_devices", devices)


def _demo(args) -> int:
    _use_emulated_devices(args.nodes * args.local)
    from zpp_jax.cli.demo import run_demo

    return run_demo(
        config=_config_from_args(args),
        nodes=args.nodes,
        local=args.local,
        layers=args.layers,
        d_model=args.d_model,
        d_ff=args.d_ff,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
    )


def _join_job(args) -> None:
    """Join a multi-process job if the environment describes one (`zpp launch`
    or a cluster launcher); then node = process and local = its devices.
    Otherwise emulate nodes x local CPU devices in this process."""
    from zpp_jax.distributed import DistributedConfig, initialize

    stages = getattr(args, "stages", 1)
    dist = DistributedConfig.from_env()
    if not dist.is_multi_process:
        args.nodes = 2 if args.nodes is None else args.nodes
        args.local = 4 if args.local is None else args.local
        what = "--stages x --nodes x --local" if stages > 1 else "--nodes x --local"
        _use_emulated_devices(max(stages, 1) * args.nodes * args.local, what)
        return
    initialize(dist, on_lost_peer=functools.partial(_lost_peer, args.command))
    import jax

    nodes, local = jax.process_count(), jax.local_device_count()
    if stages > 1:
        # The stages take the processes in turn: nodes per stage.
        if nodes % stages:
            raise UsageError(
                f"--stages {stages} does not divide the job's {nodes} processes; each stage "
                "needs whole processes (nodes)"
            )
        nodes //= stages
    for name, want, have in (("nodes", args.nodes, nodes), ("local", args.local, local)):
        if want is not None and want != have:
            raise UsageError(
                f"--{name} {want} does not match the job: {nodes} processes x {local} "
                f"devices each (node = process); drop --{name}"
            )
    args.nodes, args.local = nodes, local


def _train(args) -> int:
    from zpp_jax.cli.train import run

    # Every check that needs no device first, in every process alike: a job's
    # processes then refuse bad input together, before any of them joins.
    cfg = _run_config(args)
    _join_job(args)
    run(dataclasses.replace(cfg, nodes=args.nodes, local=args.local))
    return 0


def _run_config(args):
    """The RunConfig the `zpp train` flags describe (the mesh sizes the
    job's, once it is joined)."""
    from zpp_jax.cli.train import RunConfig

    plot = args.plot
    if plot is None and args.metrics:
        plot = _default_plot(args.metrics)
    return RunConfig(
        zero=_config_from_args(args),
        arch=args.arch,
        model=args.model,
        seq_len=args.seq,
        nodes=2 if args.nodes is None else args.nodes,
        local=4 if args.local is None else args.local,
        batch=args.batch,
        grad_accum=args.grad_accum,
        steps=args.steps,
        lr=args.lr,
        warmup=args.warmup,
        clip=args.clip,
        compute_dtype=args.compute_dtype,
        seed=args.seed,
        data=args.data,
        val_data=args.val_data,
        tokenizer=args.tokenizer,
        accept_binary=args.accept_binary,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        metrics=args.metrics,
        plot=plot,
        ckpt_dir=args.ckpt_dir,
        ckpt_every=args.ckpt_every,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.quiet,
        stages=args.stages,
        slices=args.slices,
        stage_zero=not args.no_stage_zero,
        cost=args.cost,
    )


def _default_plot(metrics: str) -> str | None:
    """The loss plot beside a metrics file, named after it (``run/m.jsonl``:
    ``run/m.png``); none for a stream (standard output, a pipe)."""
    from zpp_jax.errors import is_stream

    path = pathlib.Path(metrics)
    if is_stream(metrics) or not path.name:  # no name: `check_paths` says what is wrong
        return None
    return str(
        path.with_name(path.name + ".png") if path.suffix == ".png" else path.with_suffix(".png")
    )


def _comm(args) -> int:
    if args.target == "cpu":
        _use_emulated_devices(args.nodes * args.local)
    elif "jax" not in sys.modules:
        # The CUDA plugin cannot start without a GPU; its compile-only
        # client needs none.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import json

    import jax
    from flax import nnx

    from zpp_jax.cli.comm import BASELINES, DEFAULT_CONFIGS, compare
    from zpp_jax.mesh import make_mesh
    from zpp_jax.models import GPT, GPTConfig, Llama, LlamaConfig

    if args.seq is not None and args.seq < 1:
        raise UsageError(f"--seq must be a positive number of tokens, got {args.seq}")
    seq = {"seq_len": args.seq} if args.seq else {}
    if args.arch == "gpt":
        model = GPTConfig.preset(args.model, **seq)

        def build():
            return GPT(model, nnx.Rngs(0))
    else:
        model = LlamaConfig.preset(args.model, **seq)

        def build():
            return Llama(model, nnx.Rngs(0))

    known = [*DEFAULT_CONFIGS, *BASELINES]
    unknown = set(args.configs) - set(known)
    if unknown:
        raise UsageError(f"unknown configs {sorted(unknown)}; choose from {known}")
    configs = {
        name: BASELINES[name]
        if name in BASELINES
        else DEFAULT_CONFIGS[name].replace(persistence_threshold=args.persistence_threshold)
        for name in args.configs
    }
    if args.target == "cpu":
        mesh, make = make_mesh(args.nodes, args.local), build
    else:
        from zpp_jax.analysis import target_mesh

        mesh = target_mesh(args.nodes, args.local, args.target_config)

        def make():
            return nnx.eval_shape(build)

    compute = None if args.compute_dtype == "model" else args.compute_dtype
    reports = compare(make, mesh, args.batch, model.seq_len, configs, compute)
    if args.json:
        print(json.dumps({"configs": reports}))
        return 0
    base = reports[0]["cross_node_bytes"]
    params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(build), nnx.Param)))
    print(
        f"{args.arch} {args.model} ({params:,} parameters) on {args.target}, mesh "
        f"{args.nodes} x {args.local}, batch {args.batch} x {model.seq_len}; per device per step:"
    )
    print(
        f"{'config':10s}{'cross-node B':>16s}{'vs ' + reports[0]['name']:>10s}"
        f"{'intra-node B':>16s}{'peak memory B':>17s}{'state B':>16s}"
        + ("  overlapped / collectives" if args.target != "cpu" else "")
    )
    for r in reports:
        ratio = base / r["cross_node_bytes"] if r["cross_node_bytes"] else float("inf")
        line = (
            f"{r['name']:10s}{r['cross_node_bytes']:16,.0f}{ratio:9.2f}x"
            f"{r['intra_node_bytes']:16,.0f}{r['peak_memory_bytes']:17,}{r['state_bytes']:16,}"
        )
        if args.target != "cpu":
            line += "  " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in r["overlap"].items())
        print(line)
    if args.target != "cpu":
        print(
            "XLA's estimate of the step (its scheduler's cost model, not a measurement): "
            "step time, and communication time that no compute covers:"
        )
        for r in reports:
            est = r["estimate"]
            if est is None:
                print(
                    f"  {r['name']:10s}none: {r['estimate_withheld'] or 'no scheduler statistics'}"
                )
                continue
            exposed = sum(est["exposed_us"].values())
            kinds = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in est["exposed_us"].items() if v)
            print(
                f"  {r['name']:10s}step {est['step_us'] / 1e3:8.2f} ms   exposed "
                f"{exposed / 1e3:7.2f} ms ({exposed / est['step_us']:.1%})"
                + (f": {kinds}" if kinds else "")
            )
        print(
            "runs per step that no schedule of the program can put behind a GEMM (every "
            "GEMM of the program, or of their loop iteration, feeds them or needs them):"
        )
        for r in reports:
            some = ", ".join(f"{k} {n}" for k, n in r["unhideable"].items() if n) or "none"
            print(f"  {r['name']:10s}{some}")
        for r in reports:
            print(f"\n{r['name']}: each collective, runs per step, and what it runs behind")
            for c in r["collectives"]:
                where = "across nodes" if c["spans_nodes"] else "inside nodes"
                if c["behind"]:
                    behind = f"{len(c['behind'])} GEMMs, first {_short_op(c['behind'][0])}"
                else:
                    behind = "nothing (async, no GEMM before its done)" if c["async"] else "sync"
                if not c["hideable"]:
                    behind += "; no GEMM is independent of it"
                print(
                    f"  {c['kind']:14s}{'/'.join(c['dtypes']):14s}{c['moved_bytes']:14,.0f} B "
                    f"x{c['runs']:<3d} {where:13s} behind: {behind}"
                )
    return 0


def _short_op(op: str) -> str:
    """The end of an HLO op name: what the model was doing (``.../dot_general``)."""
    parts = [p for p in op.split("/") if p]
    return "/".join(parts[-3:])


def _launch(args) -> int:
    from zpp_jax.launch import launch

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return launch(
        argv,
        nodes=args.nodes,
        local=args.local,
        port=args.port,
        heartbeat_timeout=args.heartbeat_timeout,
        grace=args.grace,
        init_timeout=args.init_timeout,
    )


def _plan(args) -> int:
    from zpp_jax.cli.plan import run_plan

    return run_plan(args)


def _profile(args) -> int:
    from zpp_jax.cli.plan import run_profile

    if args.link:
        from zpp_jax.distributed import DistributedConfig, initialize

        dist = DistributedConfig.from_env()
        if dist.is_multi_process:
            initialize(dist, on_lost_peer=functools.partial(_lost_peer, args.command))

    return run_profile(args)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="zpp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a GPT or Llama-style model with ZeRO++ on byte-level text (the Python "
        "standard library's sources by default)",
    )
    train.add_argument(
        "--arch", default="gpt", choices=("gpt", "llama"), help="the model family (default gpt)"
    )
    train.add_argument(
        "--model", default="tiny", help="size preset: tiny, small (both), 125m (gpt)"
    )
    train.add_argument(
        "--seq", type=RUN["seq_len"], default=None, help="sequence length (preset's)"
    )
    train.add_argument(
        "--nodes", type=RUN["nodes"], default=None, help="default 2, or the job's process count"
    )
    train.add_argument(
        "--local", type=RUN["local"], default=None, help="default 4, or each process's device count"
    )
    train.add_argument("--batch", type=RUN["batch"], default=16, help="global batch (sequences)")
    train.add_argument(
        "--grad-accum", type=RUN["grad_accum"], default=1, help="micro-batches per step"
    )
    train.add_argument("--steps", type=RUN["steps"], default=200)
    train.add_argument("--lr", type=RUN["lr"], default=3e-3)
    train.add_argument("--warmup", type=RUN["warmup"], default=20)
    train.add_argument("--clip", type=RUN["clip"], default=1.0, help="global gradient-norm clip")
    train.add_argument(
        "--compute-dtype", default="bfloat16", choices=("bfloat16", "float32", "float16")
    )
    train.add_argument("--seed", type=RUN["seed"], default=0)
    train.add_argument(
        "--data",
        default=None,
        help="train on this instead of the Python standard library's source: a text file, "
        "a directory or glob of text files, or token files (.bin uint16, .npy uint16/uint32)",
    )
    train.add_argument(
        "--val-data", default=None, help="validation data (default: the last 5%% of --data)"
    )
    train.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default), bpe:N (a byte-level BPE of N ids trained on the training text), "
        "or a tokenizer.json; saved with the checkpoints and reused on --resume",
    )
    train.add_argument(
        "--accept-binary",
        action="store_true",
        help="train on --data that is not UTF-8 text (a binary file, random bytes) without the "
        "warning (--tokenizer byte) or the error (BPE, a tokenizer.json)",
    )
    train.add_argument("--eval-every", type=RUN["eval_every"], default=50)
    train.add_argument("--eval-batches", type=RUN["eval_batches"], default=4)
    train.add_argument("--metrics", default=None, help="write JSON lines here")
    train.add_argument("--plot", default=None, help="loss plot PNG (default: beside --metrics)")
    train.add_argument("--ckpt-dir", default=None)
    train.add_argument(
        "--ckpt-every", type=RUN["ckpt_every"], default=0, help="steps between checkpoints"
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --ckpt-dir from its newest intact checkpoint (the same "
        "settings are required; a missing or empty directory starts a new run)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the checkpoints in --ckpt-dir and the --metrics file of an earlier run "
        "and start a new one (without it, a run never reuses them)",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    pipe = train.add_argument_group("token pipeline (TeraPipe)")
    pipe.add_argument(
        "--stages",
        type=RUN["stages"],
        default=1,
        help="pipeline stages, each of --nodes x --local devices (default 1: no pipeline); "
        "under zpp launch, stages x nodes = processes",
    )
    pipe.add_argument(
        "--slices",
        default="auto",
        help="token slices of a sequence: auto (planned, see --cost), a count of equal "
        "slices, or the lengths l1,l2,... (default auto)",
    )
    pipe.add_argument(
        "--cost",
        default=None,
        help="cost model JSON (zpp profile) for --slices auto (default: the analytic model)",
    )
    pipe.add_argument(
        "--no-stage-zero",
        action="store_true",
        help="replicate each stage's layers over its devices instead of sharding them "
        "with the ZeRO flags",
    )
    _add_technique_flags(train)
    train.set_defaults(func=_train)

    comm = sub.add_parser(
        "comm",
        help="compile the GPT training step per configuration and report, from the HLO, "
        "every collective, the bytes per step across and inside nodes, and peak memory",
    )
    comm.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    comm.add_argument(
        "--model", default="tiny", help="gpt: tiny, small or 125m; llama: tiny, small or 7b"
    )
    comm.add_argument(
        "--target",
        choices=["cpu", "h200"],
        default="cpu",
        help="cpu: emulated CPU devices; h200: compile (not run) for H200 GPUs, with the "
        "schedule's overlap (needs the gpu-aot extra and a target description)",
    )
    comm.add_argument(
        "--target-config",
        default=None,
        help="the GPU target description (.txtpb); default: $ZPP_GPU_TARGET_CONFIG",
    )
    comm.add_argument(
        "--compute-dtype",
        default="model",
        choices=("model", "bfloat16", "float32", "float16"),
        help="dtype the gathered weights are cast to (e.g. bfloat16); default: the model's",
    )
    comm.add_argument("--seq", type=count(why="tokens"), default=None)
    comm.add_argument("--nodes", type=count(), default=2)
    comm.add_argument("--local", type=count(), default=4)
    comm.add_argument("--batch", type=count(), default=16, help="global batch (sequences)")
    comm.add_argument(
        "--configs",
        nargs="+",
        default=["zero3", "qwz", "hpz", "qgz", "zeropp"],
        help="engine configurations (zero3, qwz, hpz, qgz, zeropp, zeropp_ef) and "
        "baselines (jit: plain jax.jit with FSDP-style shardings)",
    )
    comm.add_argument(
        "--persistence-threshold",
        type=count(0, why="elements"),
        default=0,
        help="keep parameters of fewer elements whole on every device, in every "
        "engine configuration (ZeroPPConfig.persistence_threshold; default 0: shard all)",
    )
    comm.add_argument("--json", action="store_true", help="print JSON instead of a table")
    comm.set_defaults(func=_comm)

    launch = sub.add_parser(
        "launch",
        help="run a zpp subcommand as N local processes, one node each (jax.distributed, "
        "CPU devices, gloo), e.g. zpp launch --nodes 2 -- train --steps 10",
    )
    launch.add_argument("--nodes", type=LAUNCH["nodes"], default=2, help="processes (= nodes)")
    launch.add_argument(
        "--local",
        type=LAUNCH["local"],
        default=4,
        help="CPU devices per process",
    )
    launch.add_argument(
        "--port",
        type=LAUNCH["port"],
        default=None,
        help="coordinator port (default: free)",
    )
    launch.add_argument(
        "--heartbeat-timeout",
        type=LAUNCH["heartbeat_timeout"],
        default=10,
        help="seconds of silence before a process counts as dead",
    )
    launch.add_argument(
        "--init-timeout",
        type=LAUNCH["init_timeout"],
        default=30,
        help="seconds to wait for every process to join",
    )
    launch.add_argument(
        "--grace",
        type=LAUNCH["grace"],
        default=60.0,
        help="seconds the others get to fail on their own after one fails",
    )
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the zpp subcommand")
    launch.set_defaults(func=_launch)

    plan = sub.add_parser(
        "plan",
        help="TeraPipe: choose the token slicing of a sequence for a K-stage pipeline",
    )
    plan.add_argument("--layers", type=count(), default=None, help="(required without --cost)")
    plan.add_argument("--hidden", type=count(), default=None, help="(required without --cost)")
    plan.add_argument("--seq", type=count(), required=True, help="tokens per sequence")
    plan.add_argument("--stages", type=count(), required=True)
    plan.add_argument(
        "--batch",
        type=count(),
        default=1,
        help="sequences per step: B > 1 plans the joint batch x token program (microbatches, "
        "each with its own slicing)",
    )
    plan.add_argument(
        "--granularity",
        type=count(),
        default=None,
        help="tokens per planning unit (default: the finest with at most 256 units)",
    )
    plan.add_argument("--cost", default=None, help="a cost model JSON (default: analytic)")
    plan.add_argument(
        "--link-gbps",
        type=positive("Gbit/s"),
        default=None,
        help="stage-to-stage link bandwidth, Gbit/s",
    )
    plan.add_argument(
        "--link-latency-us",
        type=Number(float, 0, why="us"),
        default=None,
        help="stage-to-stage link latency, us",
    )
    plan.add_argument(
        "--link", default=None, help="a measured link (zpp profile --link) instead of the two"
    )
    plan.add_argument(
        "--act-bytes", type=count(), default=2, help="bytes per activation value on the link"
    )
    plan.add_argument(
        "--flops",
        type=positive("FLOP/s"),
        default=1e14,
        help="device FLOP/s of the analytic cost model",
    )
    plan.add_argument("--objective", default="pipeline", choices=("pipeline", "lockstep"))
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)

    prof = sub.add_parser(
        "profile",
        help="time one pipeline stage's forward+backward per (slice length, context) on "
        "this device and fit the planner's cost model",
    )
    prof.add_argument("--layers", type=count(), default=None, help="layers per stage")
    prof.add_argument("--hidden", type=count(), default=None)
    prof.add_argument(
        "--link",
        action="store_true",
        help="measure the stage-to-stage link instead: a point-to-point transfer between "
        "two processes (started here unless in a 2-process job), for zpp plan --link",
    )
    prof.add_argument(
        "--arch", default="gpt", choices=("gpt", "llama"), help="the decoder layer to time"
    )
    prof.add_argument("--heads", type=count(), default=8)
    prof.add_argument(
        "--kv-heads",
        type=count(),
        default=None,
        help="--arch llama: key/value heads (default --heads)",
    )
    prof.add_argument("--ffn", type=count(), default=None, help="MLP width (default 4 x hidden)")
    prof.add_argument("--batch", type=count(), default=1)
    prof.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    prof.add_argument("--lengths", type=count(), nargs="+", default=[16, 32, 64, 128, 256, 512])
    prof.add_argument(
        "--contexts",
        type=count(0, why="tokens before the slice"),
        nargs="+",
        default=[0, 512, 1024, 1536],
    )
    prof.add_argument(
        "--repeats", type=count(), default=None, help="timed calls per point (3; --link: 15)"
    )
    prof.add_argument(
        "--seq", type=count(), default=None, help="the pipeline's sequence length (its cache size)"
    )
    prof.add_argument("--out", default="cost.json")
    prof.set_defaults(func=_profile)

    demo = sub.add_parser(
        "demo",
        help="run sharded training steps of a transformer stack and print what moved",
    )
    demo.add_argument("--nodes", type=count(), default=2)
    demo.add_argument("--local", type=count(), default=4)
    demo.add_argument("--layers", type=count(), default=4)
    demo.add_argument("--d-model", type=count(), default=128)
    demo.add_argument("--d-ff", type=count(), default=512)
    demo.add_argument("--batch", type=count(), default=16, help="global batch (sequences)")
    demo.add_argument("--seq", type=count(), default=64)
    demo.add_argument("--steps", type=count(), default=20)
    demo.add_argument("--lr", type=positive("a learning rate"), default=3e-3)
    demo.add_argument("--seed", type=count(0, 2**32 - 1, "32 bits"), default=0)
    _add_technique_flags(demo)
    demo.set_defaults(func=_demo)
    return parser


def entry() -> None:
    """The `zpp` command: `main`, then exit with its status. A command that
    failed leaves at once, even when a library's thread is still waiting
    (a failed checkpoint save leaves orbax's writer threads waiting up to
    300 s for a directory that will never exist)."""
    code = main()
    waiting = [
        t
        for t in threading.enumerate()
        if t.is_alive() and not t.daemon and t is not threading.main_thread()
    ]
    if code != 0 and waiting:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a flag refused (2: one line said why)
        return e.code if isinstance(e.code, int) else 2
    start = time.perf_counter()
    try:
        code = _call(args)
        if _in_job():
            from zpp_jax.distributed import finish

            finish()  # no process leaves before all are done
    except UsageError as e:  # bad input: one line; anything else keeps its traceback
        print(f"zpp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _in_job():
            raise
        # In a multi-process job a failed collective almost always means that
        # another process died: say so instead of leaving only an XLA trace.
        _lost_peer(args.command, f"{type(e).__name__}: {_first_line(e)}")
    took = time.perf_counter() - start
    if code == 0:
        print(f"zpp {args.command}: done in {took:.1f} s", file=sys.stderr)
    elif code > 128:
        print(f"zpp {args.command}: stopped (status {code}) after {took:.1f} s", file=sys.stderr)
    else:
        print(f"zpp {args.command}: failed with status {code} after {took:.1f} s", file=sys.stderr)
    return code


def _call(args) -> int:
    """Run the subcommand; a run stopped by a signal (`Stopped`, after its
    checkpoint) returns 128 + the signal's number, and says what it saved."""
    from zpp_jax.preemption import Stopped

    try:
        return args.func(args)
    except Stopped as e:
        import jax

        if jax.process_index() == 0:  # every process stopped at the same step
            print(f"zpp {args.command}: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:  # SIGINT before a run could take it as a stop request
        print(f"zpp {args.command}: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT


def _lost_peer(command: str, reason: str) -> None:
    """End this process of a multi-process job whose peer is gone: one clear
    message and exit status 3, from whichever thread noticed."""
    print(
        f"zpp {command}: error: {reason}\n"
        f"zpp {command}: another process of this job has probably died or lost its "
        "connection; restart every process (with --resume to continue from the last "
        "checkpoint)",
        file=sys.stderr,
    )
    # Leave now: the orderly shutdown would wait on a barrier the dead
    # process never reaches, then abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def _in_job() -> bool:
    from zpp_jax.distributed import DistributedConfig

    try:
        return DistributedConfig.from_env().is_multi_process
    except ValueError:
        return False


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else "(no message)"


if __name__ == "__main__":
    entry()
