"""The `zpp` command (also `python -m zpp_jax`): the parser, the error
handling, and one module per subcommand (`train`, `comm`, `demo`, `plan`,
`profile`; `launch` is `zpp_jax.launch`)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import signal
import sys
import threading
import time
import traceback

from zpp_jax import config as _config
from zpp_jax.cli.args import Parser
from zpp_jax.errors import Number, UsageError, count, positive
from zpp_jax.fields import add_flags, flag_name, given_flags
from zpp_jax.launch import RANGES as LAUNCH
from zpp_jax.recipes.config import INIT_GIVES, RunConfig, default_plot, init_conflict

# A run's defaults: the technique flags' too.
_RUN = RunConfig()


def _add_technique_flags(p: argparse.ArgumentParser) -> None:
    """The ZeRO++ technique flags (`ZeroPPConfig`'s fields) and `--zero3`;
    their defaults are a run's (`RunConfig().zero`: a bf16 wire)."""
    groups = add_flags(p, _RUN.zero)
    groups[_config.TECHNIQUES].add_argument(
        "--zero3",
        action="store_true",
        help="the ZeRO-3 baseline: every technique off, bf16 wire (ZeroPPConfig.zero3())",
    )
    groups[_config.TECHNIQUES].add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="start from the ZeroPPConfig in FILE (zpp tune writes one; "
        "ZeroPPConfig.to_file); technique flags given change its fields",
    )


# A technique's own settings: a flag of these with its technique off does nothing.
_SETTINGS_OF = {
    "quantize_weights": ("weight_bits", "block_size"),
    "quantize_gradients": (
        "gradient_bits",
        "gradient_block_size",
        "gradient_rounding",
        "gradient_scale_dtype",
    ),
}


def _config_from_args(args):
    """The ZeroPPConfig the technique flags describe."""
    given = given_flags(_config.ZeroPPConfig, args)
    common = {name: given.pop(name) for name in ("comm_dtype", "remat") if name in given}
    if args.config is not None:
        if args.zero3:
            raise UsageError(
                f"--zero3 and --config {args.config} both choose the techniques; drop one"
            )
        config = _config.ZeroPPConfig.from_file(args.config).replace(**given, **common)
        return _check_settings_take_effect(config, given)
    if args.zero3:
        if given:
            fields = {f.name: f for f in dataclasses.fields(_config.ZeroPPConfig)}
            flags = ", ".join(flag_name(fields[name]) for name in given)
            it = "them" if len(given) > 1 else "it"
            raise UsageError(
                f"--zero3 turns every ZeRO++ technique off, so {flags} would have no effect; "
                f"drop {it}, or drop --zero3 and switch techniques off one by one "
                "(--no-qwz, --no-hpz, --no-qgz)"
            )
        base = {"comm_dtype": _RUN.zero.comm_dtype, "remat": _RUN.zero.remat}
        return _config.ZeroPPConfig.zero3(**{**base, **common})
    return _check_settings_take_effect(_RUN.zero.replace(**given, **common), given)


def _check_settings_take_effect(config, given: dict):
    """`config`, unless a flag in `given` sets a technique's own setting
    while that technique is off (UsageError naming both)."""
    fields = {f.name: f for f in dataclasses.fields(_config.ZeroPPConfig)}
    for technique, settings in _SETTINGS_OF.items():
        idle = [flag_name(fields[name]) for name in settings if name in given]
        if idle and not getattr(config, technique):
            switch = flag_name(fields[technique])
            raise UsageError(
                f"{', '.join(idle)} would have no effect: {switch} switches that technique "
                "off; drop one"
            )
    return config


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


def _join_job(command: str, cfg, given: dict) -> tuple[int, int]:
    """Join a multi-process job if the environment describes one (`zpp launch`
    or a cluster launcher); then node = process and local = its devices.
    Otherwise emulate nodes x local CPU devices in this process. `cfg`: a
    `RunConfig` or a `TuneConfig` (no stages). Returns the run's (nodes,
    local)."""
    from zpp_jax.distributed import DistributedConfig, initialize

    dist = DistributedConfig.from_env()
    stages = getattr(cfg, "stages", 1)
    if not dist.is_multi_process:
        what = "--stages x --nodes x --local" if stages > 1 else "--nodes x --local"
        _use_emulated_devices(stages * cfg.nodes * cfg.local, what)
        return cfg.nodes, cfg.local
    initialize(dist, on_lost_peer=functools.partial(_lost_peer, command))
    import jax

    nodes, local = jax.process_count(), jax.local_device_count()
    if stages > 1:
        # The stages take the processes in turn: nodes per stage.
        if nodes % stages:
            raise UsageError(
                f"--stages {stages} does not divide the job's {nodes} processes; each "
                "stage needs whole processes (nodes)"
            )
        nodes //= stages
    for name, have in (("nodes", nodes), ("local", local)):
        if name in given and given[name] != have:
            raise UsageError(
                f"--{name} {given[name]} does not match the job: {nodes} processes x {local} "
                f"devices each (node = process); drop --{name}"
            )
    return nodes, local


def _train(args) -> int:
    from zpp_jax.recipes.train import run

    # Every check that needs no device first, in every process alike: a job's
    # processes then refuse bad input together, before any of them joins.
    cfg, given = _run_config(args)
    nodes, local = _join_job(args.command, cfg, given)
    run(dataclasses.replace(cfg, nodes=nodes, local=local))
    return 0


def _run_config(args) -> tuple[RunConfig, dict]:
    """The RunConfig the `zpp train` flags describe (the mesh sizes the
    job's, once it is joined), and the flags given."""
    given = given_flags(RunConfig, args)
    if "init" in given:
        contradicting = [f"--{name}" for name in INIT_GIVES if name in given]
        if contradicting:
            raise UsageError(init_conflict(given["init"], contradicting))
    fields = dict(given)
    if "plot" not in given and given.get("metrics"):
        fields["plot"] = default_plot(given["metrics"])
    return RunConfig(zero=_config_from_args(args), **fields), given


def _comm(args) -> int:
    if args.target == "cpu":
        _use_emulated_devices(args.nodes * args.local)
    else:
        _compile_only()
    from zpp_jax.cli.comm import run_comm

    return run_comm(args)


def _compile_only() -> None:
    """Compiling for a GPU target: the CUDA plugin cannot start without a
    GPU, and its compile-only client needs none, so JAX runs on CPU."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
    """The `zpp` command line: one subparser per command."""
    parser = Parser(prog="zpp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _comm_parser(sub)
    _launch_parser(sub)
    _plan_parser(sub)
    _profile_parser(sub)
    _demo_parser(sub)
    _export_parser(sub)
    _sample_parser(sub)
    _tune_parser(sub)
    return parser


def _train_parser(sub) -> None:
    train = sub.add_parser(
        "train",
        help="train a GPT or Llama-style model with ZeRO++ on byte-level text (the Python "
        "standard library's sources by default)",
    )
    add_flags(train, _RUN)
    _add_technique_flags(train)
    train.set_defaults(func=_train)


def _comm_parser(sub) -> None:
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
    comm.add_argument(
        "--layers",
        type=count(why="layers"),
        default=None,
        help="number of layers (default: the preset's): the same widths, deeper or shallower",
    )
    comm.add_argument("--nodes", type=count(), default=2)
    comm.add_argument("--local", type=count(), default=4)
    comm.add_argument("--batch", type=count(), default=16, help="global batch (sequences)")
    comm.add_argument(
        "--configs",
        nargs="+",
        default=["zero3", "qwz", "hpz", "qgz", "zeropp"],
        help="engine configurations (zero3, qwz, hpz, qgz, zeropp, zeropp_ef) and "
        "baselines (jit: plain jax.jit with FSDP-style parameter shardings, XLA "
        "partitioning the rest; jit_fsdp: the same with activations constrained to "
        "the batch axes, as MaxText writes FSDP; nocomm: the limit, one device's program "
        "with nothing exchanged, each device training a replica of its own)",
    )
    comm.add_argument(
        "--persistence-threshold",
        type=count(0, why="elements"),
        default=0,
        help="keep parameters of fewer elements whole on every device, in every "
        "engine configuration (ZeroPPConfig.persistence_threshold; default 0: shard all)",
    )
    # The step of LoRA adapters over the frozen base (engine configs): the
    # flags `zpp train` has, defined once on their fields.
    add_flags(comm, _RUN, only=("lora", "tp"))
    # The engine configurations' recomputation (the baselines keep what XLA keeps).
    add_flags(comm, _RUN.zero, only=("frozen_bits", "remat"))
    comm.set_defaults(
        lora=_RUN.lora, tp=_RUN.tp, frozen_bits=_RUN.zero.frozen_bits, remat=_RUN.zero.remat
    )
    comm.add_argument("--json", action="store_true", help="print JSON instead of a table")
    comm.set_defaults(func=_comm)


def _launch_parser(sub) -> None:
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


def _plan_parser(sub) -> None:
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


def _profile_parser(sub) -> None:
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


def _export_parser(sub) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face checkpoint (config.json, safetensors, "
        "tokenizer.json) that transformers' from_pretrained reads",
    )
    export.add_argument("--ckpt-dir", required=True, help="the run's checkpoint directory")
    export.add_argument("--hf", required=True, metavar="OUT", help="the directory to write")
    export.add_argument(
        "--step", type=count(0, why="a checkpoint's step"), help="(default: the newest)"
    )
    export.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32", "float16"),
        help="the weights' dtype (default bfloat16)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace what --hf holds")
    export.add_argument(
        "--merge-onto",
        choices=("base", "codes"),
        help="a LoRA run's adapters are merged onto the base checkpoint's own kernels (base, "
        "the default: as a merge onto an unquantized base gives them) or onto the codes the "
        "run computed with (codes: exactly the trained model)",
    )
    export.add_argument(
        "--base",
        metavar="DIR",
        help="the LoRA run's --init checkpoint, if it has moved (default: where the run read it)",
    )
    export.set_defaults(func=_export)


def _emulate_saved_mesh(ckpt_dir: str, step: int | None) -> None:
    """On CPU, as many emulated devices as the checkpoint's mesh had (set
    before JAX starts): a run's frozen codes restore onto that shape."""
    from zpp_jax.checkpoint import Checkpointer

    mesh = Checkpointer.saved_mesh(ckpt_dir, step)
    if mesh:
        _use_emulated_devices(math.prod(mesh.values()), "the checkpoint's mesh")


def _export(args) -> int:
    _emulate_saved_mesh(args.ckpt_dir, args.step)
    from zpp_jax.recipes.export import export_hf

    options = ("step", "dtype", "overwrite", "merge_onto", "base")
    written = export_hf(args.ckpt_dir, args.hf, **{name: getattr(args, name) for name in options})
    print(f"zpp export: wrote {len(written)} files to {args.hf}", file=sys.stderr)
    return 0


def _sample_parser(sub) -> None:
    sample = sub.add_parser(
        "sample", help="decode text from a run's checkpoint (greedy, or with a temperature)"
    )
    sample.add_argument("--ckpt-dir", required=True, help="the run's checkpoint directory")
    sample.add_argument("--prompt", required=True, help="the text to continue")
    sample.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message: render it with the checkpoint's chat template "
        "and write the assistant's reply, up to its end of turn",
    )
    sample.add_argument(
        "--max-tokens",
        type=count(why="tokens to write"),
        default=None,
        help="tokens to write at most (default 64, or fewer where the model's positions end)",
    )
    sample.add_argument(
        "--temperature",
        type=Number(float, 0, why="0 is greedy"),
        default=0.0,
        help="0: greedy; above: sample from the softmax of logits / T (default 0)",
    )
    sample.add_argument("--seed", type=count(0, 2**32 - 1, "32 bits"), default=0)
    sample.add_argument(
        "--step", type=count(0, why="a checkpoint's step"), help="(default: the newest)"
    )
    sample.set_defaults(func=_sample)


def _sample(args) -> int:
    _emulate_saved_mesh(args.ckpt_dir, args.step)
    from zpp_jax.recipes.sample import sample_run

    text = sample_run(
        args.ckpt_dir,
        args.prompt,
        args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        step=args.step,
        chat=args.chat,
    )
    print(text if args.chat else args.prompt + text)
    return 0


def _tune_parser(sub) -> None:
    from zpp_jax.recipes.tune import TuneConfig

    tune = sub.add_parser(
        "tune",
        help="choose the ZeRO++ settings for a model, mesh, batch and link: compile and time "
        "(or, for GPUs, estimate) the candidates, print them ranked, write the winner's config",
    )
    add_flags(tune, TuneConfig())
    tune.set_defaults(func=_tune)


def _tune(args) -> int:
    from zpp_jax.recipes.tune import TuneConfig

    given = given_flags(TuneConfig, args)
    cfg = TuneConfig(**given)
    if cfg.target == "cpu":
        nodes, local = _join_job(args.command, cfg, given)
    else:
        _compile_only()
        nodes, local = cfg.nodes, cfg.local
        _use_emulated_devices(nodes * local)  # the numerics run on CPU devices
    from zpp_jax.recipes.tune_run import run_tune_command

    return run_tune_command(dataclasses.replace(cfg, nodes=nodes, local=local))


def _demo_parser(sub) -> None:
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
        # another process died: say so after the trace, which shows the cause
        # when it was this process's own.
        traceback.print_exc()
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
