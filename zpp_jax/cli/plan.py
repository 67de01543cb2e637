"""`zpp plan` and `zpp profile`: TeraPipe's token slicing, and the cost
model it plans with, measured on this device."""

from __future__ import annotations

import pathlib

from zpp_jax.errors import UsageError, check_writable_file


def plan_cost(args):
    """The cost model `zpp plan` plans with, and words for where it came from.

    With --cost the file's model; --layers/--hidden, if also given, must agree
    with it. Without, the analytic model of ceil(layers / stages) layers.
    --link-gbps/--link-latency-us or --link add the stage-to-stage transfer."""
    import math

    from zpp_jax.pipeline import AnalyticCost, load_cost
    from zpp_jax.pipeline.cost import LinkCost

    for name in ("layers", "hidden", "seq", "stages", "batch", "granularity"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name} must be positive, got {value}")
    if args.cost is None and (args.layers is None or args.hidden is None):
        raise UsageError("--layers and --hidden are required without --cost")
    if args.layers is not None and args.stages > args.layers:
        raise UsageError(
            f"--stages {args.stages} is more than the {args.layers} layers: every stage needs "
            f"at least one layer; use at most --stages {args.layers}"
        )
    per_stage = None if args.layers is None else math.ceil(args.layers / args.stages)
    if args.cost:
        cost, source = load_cost(args.cost), f"cost from {args.cost}"
        _check_agrees(args, cost, per_stage)
    else:
        cost = AnalyticCost(hidden=args.hidden, layers=per_stage, flops=args.flops)
        source = "analytic cost"
    link = _link(args)
    if link is not None:
        hidden = args.hidden or _hidden_of(cost)
        if hidden is None:
            raise UsageError("the link term needs the activation width: pass --hidden")
        cost = LinkCost(cost, hidden, link[0], link[1], args.act_bytes)
        source += f", link {link[0] * 8 / 1e9:g} Gbit/s + {link[1] * 1e6:g} us"
    return cost, source


def _link(args):
    """(bytes per second, latency in seconds) of the stage link, or None."""
    import json
    import pathlib

    given = args.link_gbps is not None or args.link_latency_us is not None
    if args.link and given:
        raise UsageError("--link reads a measured link; drop --link-gbps/--link-latency-us")
    if args.link:
        try:
            data = json.loads(pathlib.Path(args.link).read_text())
            return float(data["bytes_per_s"]), float(data["latency_s"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(
                f"--link {args.link}: not a link measurement (zpp profile --link): {e}"
            ) from None
    if not given:
        return None
    if args.link_gbps is None or not args.link_gbps > 0:
        raise UsageError(f"--link-gbps must be a positive bandwidth, got {args.link_gbps}")
    latency = args.link_latency_us or 0.0
    if not latency >= 0:
        raise UsageError(f"--link-latency-us must be >= 0, got {latency}")
    return args.link_gbps * 1e9 / 8, latency * 1e-6


def _hidden_of(cost):
    inner = getattr(cost, "compute", cost)
    return getattr(cost, "hidden", None) or getattr(inner, "hidden", None)


def _check_agrees(args, cost, per_stage) -> None:
    """--layers/--hidden given with --cost must describe the file's model."""
    inner = getattr(cost, "compute", cost)
    if per_stage is not None and inner.layers != per_stage:
        raise UsageError(
            f"--cost {args.cost} models {inner.layers} layers per stage, but --layers "
            f"{args.layers} on --stages {args.stages} gives {per_stage}; drop --layers or "
            "profile the stage you plan for"
        )
    hidden = _hidden_of(cost)
    if args.hidden is not None and hidden is not None and hidden != args.hidden:
        raise UsageError(
            f"--cost {args.cost} models hidden {hidden}, not --hidden {args.hidden}; drop "
            "--hidden or use a cost model of that width"
        )


def run_plan(args) -> int:
    import json

    from zpp_jax.pipeline import best_uniform, latency, plan_batch, plan_tokens
    from zpp_jax.pipeline.planner import auto_granularity, folded

    cost, source = plan_cost(args)
    granularity, how = args.granularity, ""
    if granularity is None:
        granularity, how = auto_granularity(args.seq), " (auto)"
    if args.batch > 1 and args.objective != "pipeline":
        raise UsageError(
            "--batch plans the joint batch x token program, which has the pipeline "
            "objective; drop --objective lockstep"
        )
    kw = dict(granularity=granularity, batch=args.batch, objective=args.objective)
    one = plan_tokens(args.seq, args.stages, cost, **kw)
    uniform = best_uniform(args.seq, args.stages, cost, **kw)
    whole = latency((args.seq,), cost, args.stages, args.batch, args.objective)
    joint = (
        plan_batch(args.batch, args.seq, args.stages, cost, granularity) if args.batch > 1 else None
    )
    if args.json:
        out = {
            "objective": args.objective,
            "granularity": granularity,
            "cost": cost.to_json(),
            "plan": {"slices": list(one.slices), "latency_s": one.latency},
            "uniform": {"slices": list(uniform.slices), "latency_s": uniform.latency},
            "no_slicing": {"slices": [args.seq], "latency_s": whole},
        }
        if joint is not None:
            out["one_microbatch"] = out["plan"]
            out["plan"] = {
                "microbatches": [[b, list(s)] for b, s in joint.microbatches],
                "latency_s": joint.latency,
            }
        print(json.dumps(out))
        return 0
    layers = f"{args.layers} layers on " if args.layers else ""
    print(
        f"{layers}{args.stages} stages, {args.batch} x {args.seq} tokens, granularity "
        f"{granularity}{how}, {source}, {args.objective} objective"
    )
    rows = []
    if joint is not None:
        micro = "; ".join(f"{b} x [{folded(s)}]" for b, s in joint.microbatches)
        rows.append(("planner", joint.latency, f"{len(joint.microbatches)} microbatches: {micro}"))
        name = "1 microbatch"
    else:
        name = "planner"
    rows.append((name, one.latency, f"{len(one.slices)} slices: {folded(one.slices)}"))
    rows.append(
        ("best uniform", uniform.latency, f"{len(uniform.slices)} slices: {folded(uniform.slices)}")
    )
    for name, t, what in rows:
        speedup = whole / t if t > 0 else float("inf")
        print(f"{name:13s} {t * 1e3:12.3f} ms  {speedup:6.2f}x vs no slicing  {what}")
    print(f"{'no slicing':13s} {whole * 1e3:12.3f} ms")
    return 0


def run_link_profile(args) -> int:
    """`zpp profile --link`: in a 2-process job, measure the link and
    (process 0) write it; outside one, start that job on this machine."""
    import json

    from zpp_jax.distributed import DistributedConfig

    repeats = 15 if args.repeats is None else args.repeats
    check_writable_file("--out", pathlib.Path(args.out))
    if not DistributedConfig.from_env().is_multi_process:
        from zpp_jax.launch import launch

        argv = ["profile", "--link", "--out", args.out, "--repeats", str(repeats)]
        return launch(argv, nodes=2, local=1)
    import jax

    from zpp_jax.pipeline.profile import measure_link

    link = measure_link(repeats=repeats)
    if jax.process_index() == 0:
        pathlib.Path(args.out).write_text(json.dumps(link, indent=1))
        print(
            f"link: {link['bytes_per_s'] * 8 / 1e9:.3f} Gbit/s, {link['latency_s'] * 1e6:.1f} us "
            f"latency (fitted to {len(link['points'])} sizes); written to {args.out}"
        )
    return 0


def run_profile(args) -> int:
    if args.link:
        return run_link_profile(args)
    if args.layers is None or args.hidden is None:
        raise UsageError("zpp profile needs --layers and --hidden (or --link)")
    check_writable_file("--out", pathlib.Path(args.out))
    longest = max(args.lengths) + max(args.contexts)
    if args.seq is not None and longest > args.seq:
        raise UsageError(
            f"--seq {args.seq} is shorter than the longest slice after the longest context "
            f"({max(args.lengths)} + {max(args.contexts)} = {longest} tokens); a pipeline of "
            "that length never runs it: give a longer --seq, or shorter --lengths/--contexts"
        )
    import dataclasses

    from flax import nnx

    from zpp_jax.models import GPT, GPTConfig, Llama, LlamaConfig
    from zpp_jax.pipeline.cost import save_cost
    from zpp_jax.pipeline.profile import profile_stage

    sizes = dict(
        seq_len=max(args.lengths) + max(args.contexts),
        d_model=args.hidden,
        n_layers=args.layers,
        n_heads=args.heads,
        d_ff=args.ffn or 4 * args.hidden,
        dtype=args.dtype,
    )
    if args.arch == "llama":
        cfg, model_class = LlamaConfig(**sizes, n_kv_heads=args.kv_heads or args.heads), Llama
    elif args.kv_heads is not None:
        raise UsageError("--kv-heads sets the Llama's key/value heads: pass --arch llama with it")
    else:
        cfg, model_class = GPTConfig(**sizes), GPT

    def make_model(layers: int):
        return model_class(dataclasses.replace(cfg, n_layers=layers), nnx.Rngs(0))

    cost, _ = profile_stage(
        make_model,
        args.layers,
        args.lengths,
        args.contexts,
        args.batch,
        3 if args.repeats is None else args.repeats,
        log=print,
        seq_len=args.seq,
    )
    save_cost(cost, args.out)
    print(f"fitted cost model (one stage of {args.layers} layers) written to {args.out}")
    return 0
