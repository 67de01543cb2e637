"""`zpp plan` and `zpp profile`: TeraPipe's token slicing, and the cost
model it plans with, measured on this device."""

from __future__ import annotations

from zpp_jax.errors import UsageError


def run_plan(args) -> int:
    import json
    import math

    from zpp_jax.pipeline import AnalyticCost, best_uniform, latency, load_cost, plan_tokens

    for name in ("layers", "hidden", "seq", "stages", "batch", "granularity"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be positive, got {getattr(args, name)}")
    per_stage = math.ceil(args.layers / args.stages)
    if args.cost:
        cost = load_cost(args.cost)
    else:
        cost = AnalyticCost(hidden=args.hidden, layers=per_stage, flops=args.flops)
    kw = dict(granularity=args.granularity, batch=args.batch, objective=args.objective)
    plan = plan_tokens(args.seq, args.stages, cost, **kw)
    uniform = best_uniform(args.seq, args.stages, cost, **kw)
    whole = latency((args.seq,), cost, args.stages, args.batch, args.objective)
    if args.json:
        out = {
            "objective": args.objective,
            "layers_per_stage": per_stage,
            "cost": cost.to_json(),
            "plan": {"slices": list(plan.slices), "latency_s": plan.latency},
            "uniform": {"slices": list(uniform.slices), "latency_s": uniform.latency},
            "no_slicing": {"slices": [args.seq], "latency_s": whole},
        }
        print(json.dumps(out))
        return 0
    print(
        f"{args.layers} layers on {args.stages} stages ({per_stage} per stage), hidden "
        f"{args.hidden}, {args.batch} x {args.seq} tokens, granularity {args.granularity}, "
        f"{'cost from ' + args.cost if args.cost else 'analytic cost'}, {args.objective} objective"
    )
    rows = [("planner", plan), ("best uniform", uniform)]
    for name, p in rows:
        speedup = whole / p.latency if p.latency > 0 else float("inf")
        print(
            f"{name:13s} {p.latency * 1e3:12.3f} ms  {speedup:6.2f}x vs no slicing  "
            f"{len(p.slices)} slices: {folded(p.slices)}"
        )
    print(f"{'no slicing':13s} {whole * 1e3:12.3f} ms")
    return 0


def run_profile(args) -> int:
    from zpp_jax.models.gpt import GPTConfig
    from zpp_jax.pipeline.cost import save_cost
    from zpp_jax.pipeline.profile import profile_stage

    cfg = GPTConfig(
        seq_len=max(args.lengths) + max(args.contexts),
        d_model=args.hidden,
        n_layers=args.layers,
        n_heads=args.heads,
        d_ff=args.ffn or 4 * args.hidden,
        dtype=args.dtype,
    )
    cost, _ = profile_stage(
        cfg,
        args.layers,
        args.lengths,
        args.contexts,
        args.batch,
        args.repeats,
        log=print,
        seq_len=args.seq,
    )
    save_cost(cost, args.out)
    print(f"fitted cost model (one stage of {args.layers} layers) written to {args.out}")
    return 0


def folded(slices) -> str:
    """Slice lengths with repeats folded: 16x8, 4x16."""
    out, i = [], 0
    while i < len(slices):
        j = i
        while j < len(slices) and slices[j] == slices[i]:
            j += 1
        out.append(f"{j - i}x{slices[i]}" if j - i > 1 else str(slices[i]))
        i = j
    return ", ".join(out)
