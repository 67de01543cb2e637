"""`zpp comm`: what one training step communicates and keeps, per
configuration, read from the compiled program (nothing is run).

For each configuration the model's training step is compiled on the mesh;
every collective of its HLO is listed (kind, dtypes, bytes, replica groups,
runs per step with loop trip counts, whether its group spans nodes) and the
per-device bytes per step are totalled by the ring model, across and inside
nodes. Peak memory per device comes from `memory_analysis()`, next to the
bytes of the training state one device holds (parameters, optimizer state,
error-feedback residuals). For a GPU target (compiled, not run: see
`zpp_jax.analysis.target`) each collective also shows what it is scheduled behind.
Besides the engine's configurations, two baselines a user would otherwise
write: "jit", plain `jax.jit` with FSDP-style parameter shardings and XLA
choosing the rest (`JitFSDP`), and "jit_fsdp", the same with every layer's
activations constrained to the batch axes (`JitFSDP(constrain_activations=
True)`, FSDP as MaxText writes it). And the limit both are measured
against: "nocomm", one device's program with nothing exchanged
(`NoCommunication`). On a GPU target each estimated step also shows its
MFU (model FLOPs, `device_training_flops`, over the step x the GPU's
matrix peak) and its ratio to the no-communication step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zpp_jax.analysis import step_report, target_mesh
from zpp_jax.analysis.flops import training_flops
from zpp_jax.analysis.report import exposed_by_unit, exposed_time_by_unit, links_and_compute, mfu
from zpp_jax.baseline import JitFSDP, NoCommunication
from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.lora import FROZEN, add_lora
from zpp_jax.mesh import data_size, make_mesh, model_size
from zpp_jax.models import preset
from zpp_jax.models.names import TENSOR_PARALLEL_RULES, check_heads, name_axes
from zpp_jax.recipes.config import check_degree
from zpp_jax.train import Trainer, next_token_loss

DEFAULT_CONFIGS = {
    "zero3": ZeroPPConfig.zero3(),
    "qwz": ZeroPPConfig(comm_dtype="bfloat16", hpz=False, quantize_gradients=False),
    "hpz": ZeroPPConfig.zero3(hpz=True),
    "qgz": ZeroPPConfig(comm_dtype="bfloat16", quantize_weights=False, hpz=False),
    "zeropp": ZeroPPConfig(comm_dtype="bfloat16"),
    "zeropp_ef": ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True),
}
# Methods that are not the engine's, compared with it: name -> builder.
# "nocomm" is the limit: one device's program, nothing exchanged.
BASELINES = {
    "jit": JitFSDP,
    "jit_fsdp": functools.partial(JitFSDP, constrain_activations=True),
    "nocomm": NoCommunication,
}


def compare(
    make_model: Callable[[], nnx.Module],
    mesh,
    batch: int,
    seq_len: int,
    configs=None,
    compute_dtype=None,
    freeze=None,
    rules=None,
) -> list[dict]:
    """`step_report` of a language model's training step (AdamW) for each
    configuration (default: ZeRO-3, each technique alone, all three), on
    token batches of `batch` x `seq_len`. A configuration is a
    `ZeroPPConfig` (a `Trainer` of the engine) or a baseline's builder
    from `BASELINES` (reported with ``config`` ``{"baseline": name}``).
    `make_model` may build the model abstractly (``nnx.eval_shape``), as it
    must for a compile-only mesh (`zpp_jax.analysis.target_mesh`).
    `freeze` (the engine's configurations only): the parameters that train
    nothing, and `rules`, the logical axis rules of its sharding names (a
    mesh with a `model` axis), as `zpp.shard` takes them."""
    configs = DEFAULT_CONFIGS if configs is None else configs
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    # Counted on the model's shapes: a concrete `make_model` is not built again for it.
    # A data device's rows are split `model_size` ways (each rank runs 1/t of
    # every matrix multiply, as MFU counts a GPU's share of the model FLOPs).
    rows = batch // data_size(mesh)
    flops = device_training_flops(nnx.eval_shape(make_model), rows, seq_len) // model_size(mesh)
    reports = []
    for name, cfg in configs.items():
        if isinstance(cfg, ZeroPPConfig):
            kw = dict(compute_dtype=compute_dtype, freeze=freeze, rules=rules)
            step = Trainer(make_model(), optax.adamw(1e-3), mesh, cfg, **kw)
            described = dataclasses.asdict(cfg)
        else:  # a baseline's builder (`BASELINES`), and its names' rules under TP
            kw = {} if rules is None else {"rules": rules}
            step = cfg(make_model(), optax.adamw(1e-3), mesh, compute_dtype=compute_dtype, **kw)
            described = {"baseline": name}
        report = step_report(step, {"inputs": tokens, "targets": tokens})
        reports.append(
            {
                "name": name,
                "config": described,
                **report,
                "model_flops": flops,
                "mfu": mfu(report["estimate"], flops),
            }
        )
    return reports


def device_training_flops(model: nnx.Module, rows: int, seq_len: int) -> int:
    """Model FLOPs of one device's share of a training step: `rows` token
    sequences of `seq_len` (`zpp_jax.analysis.flops.training_flops` of the
    next-token loss). `model` may be abstract."""
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)

    def loss(state, batch):
        return next_token_loss(nnx.merge(graphdef, state), batch)

    return training_flops(loss, state, {"inputs": tokens, "targets": tokens})


def run_comm(args) -> int:
    """`zpp comm`: compile the step per configuration and print what it
    moves and keeps (a table, or JSON with ``--json``)."""
    model, build = _model(args)
    known = [*DEFAULT_CONFIGS, *BASELINES]
    unknown = set(args.configs) - set(known)
    if unknown:
        raise UsageError(f"unknown configs {sorted(unknown)}; choose from {known}")
    configs = {
        name: BASELINES[name]
        if name in BASELINES
        else DEFAULT_CONFIGS[name].replace(
            persistence_threshold=args.persistence_threshold,
            frozen_bits=args.frozen_bits,
            remat=args.remat,
        )
        for name in args.configs
    }
    freeze = None
    if args.lora is not None:
        if set(args.configs) & set(BASELINES):
            raise UsageError("--lora compiles the engine's LoRA step; drop the baselines (jit)")
        freeze = FROZEN
    rules = _check_tensor_parallel(args, model)
    if args.target == "cpu":
        mesh = make_mesh(args.nodes, args.local // args.tp, model=args.tp)
    else:
        mesh = target_mesh(args.nodes, args.local, args.target_config, model=args.tp)

    def make():  # compiled, never run: the model's shapes are all a step needs
        return nnx.eval_shape(build)

    compute = None if args.compute_dtype == "model" else args.compute_dtype
    reports = compare(make, mesh, args.batch, model.seq_len, configs, compute, freeze, rules)
    if args.json:
        print(json.dumps({"configs": reports}))
        return 0
    _print_table(args, model, build, reports)
    if args.target != "cpu":
        _print_schedule(reports)
    return 0


def _check_tensor_parallel(args, model) -> tuple | None:
    """The logical rules of `--tp` (None without it), once it is checked
    against the mesh, the model's heads and the configurations."""
    if args.tp == 1:
        return None
    check_degree(args.tp, args.local)
    other = sorted(set(args.configs) & {"nocomm", "zeropp_ef"})
    if other or args.lora is not None:
        what = " and ".join(other) if other else "--lora"
        raise UsageError(f"--tp does not yet combine with {what}: drop one")
    check_heads(model, args.tp)
    return TENSOR_PARALLEL_RULES


def _model(args):
    """(The model's config, a function that builds it) for `args`."""
    if args.seq is not None and args.seq < 1:
        raise UsageError(f"--seq must be a positive number of tokens, got {args.seq}")
    overrides = {"seq_len": args.seq} if args.seq else {}
    if args.layers:
        overrides["n_layers"] = args.layers
    model, model_class = preset(args.arch, args.model, **overrides)

    def build():
        made = model_class(model, nnx.Rngs(0))
        made = made if args.lora is None else add_lora(made, args.lora)
        return name_axes(made) if args.tp > 1 else made

    return model, build


def _print_table(args, model, build, reports: list[dict]) -> None:
    base = reports[0]["cross_node_bytes"]
    params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(build), nnx.Param)))
    lora = ""
    if args.lora is not None:
        lora = f", LoRA of rank {args.lora} over a base of {args.frozen_bits or 'own-dtype'} bits"
    layers = f", {model.n_layers} layers" if args.layers else ""
    tp = f" (x tp {args.tp}: {args.local // args.tp} data devices a node)" if args.tp > 1 else ""
    print(
        f"{args.arch} {args.model}{layers} ({params:,} parameters{lora}) on {args.target}, mesh "
        f"{args.nodes} x {args.local}{tp}, batch {args.batch} x {model.seq_len}; per device per "
        "step:"
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


def _print_schedule(reports: list[dict]) -> None:
    """A GPU target's schedule: XLA's estimate, what no schedule can hide,
    and what each collective runs behind."""
    print(
        "XLA's estimate of the step (its scheduler's cost model on the schedule it made, "
        "collectives priced on the link model and run one at a time on one communication "
        "stream, as XLA:GPU runs them; not a measurement): step time, communication time "
        "that no compute covers, the kernels alone, and each link's busy time (a floor "
        "under the step):"
    )
    limit = next((r["estimate"] for r in reports if r["name"] == "nocomm"), None)
    for r in reports:
        est = r["estimate"]
        if est is None:
            print(f"  {r['name']:10s}none: {r['estimate_withheld'] or 'no scheduler statistics'}")
            continue
        exposed = sum(est["exposed_us"].values())
        kinds = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in est["exposed_us"].items() if v)
        print(
            f"  {r['name']:10s}step {est['step_us'] / 1e3:8.2f} ms   exposed "
            f"{exposed / 1e3:7.2f} ms ({exposed / est['step_us']:.1%})"
            + (f": {kinds}" if kinds else "")
        )
        print(f"  {'':10s}{links_and_compute(est)}")
        if r["mfu"] is not None or limit:
            print(f"  {'':10s}{_against_the_limit(r, limit)}")
    print(
        "runs per step that no schedule of the program can put behind a GEMM (every "
        "GEMM of the program, or of their loop iteration, feeds them or needs them):"
    )
    for r in reports:
        some = ", ".join(f"{k} {n}" for k, n in r["unhideable"].items() if n) or "none"
        print(f"  {r['name']:10s}{some}")
    print("exposed communication (the estimate), ms, by unit (its path) and kind:")
    for r in reports:
        if r["estimate"] is None:
            continue
        print(f"  {r['name']}:")
        for unit, kinds in list(exposed_time_by_unit(r["estimate"]).items())[:12]:
            listed = ", ".join(f"{k} {us / 1e3:.2f}" for k, us in kinds.items())
            print(f"    {unit or '(no unit)':24s}{listed}")
    print("runs per step behind no GEMM, by unit (its path) and kind:")
    for r in reports:
        print(f"  {r['name']}:")
        for unit, kinds in exposed_by_unit(r["collectives"]).items():
            listed = ", ".join(f"{k} x{n}" for k, n in kinds.items())
            print(f"    {unit or '(no unit)':24s}{listed}")
    for r in reports:
        print(f"\n{r['name']}: each collective, runs per step, and what it runs behind")
        for c in r["collectives"]:
            print("  " + _collective_line(c))


def _against_the_limit(report: dict, limit: dict | None) -> str:
    """MFU of a report's estimated step, and the step over the
    no-communication step's (`limit`: the "nocomm" estimate, or None)."""
    parts = []
    if report["mfu"] is not None:
        tflops = report["model_flops"] / 1e12
        parts.append(f"MFU {report['mfu']:.1%} ({tflops:.2f} model TFLOPs per GPU per step)")
    if limit:
        parts.append(
            f"{report['estimate']['step_us'] / limit['step_us']:.3f}x the no-communication step"
        )
    return "; ".join(parts)


def _collective_line(c: dict) -> str:
    where = "across nodes" if c["spans_nodes"] else "inside nodes"
    if c["behind"]:
        behind = f"{len(c['behind'])} GEMMs, first {_short_op(c['behind'][0])}"
    else:
        behind = "nothing (async, no GEMM before its done)" if c["async"] else "sync"
    if not c["hideable"]:
        behind += "; no GEMM is independent of it"
    return (
        f"{c['kind']:14s}{'/'.join(c['dtypes']):14s}{c['moved_bytes']:14,.0f} B "
        f"x{c['runs']:<3d} {where:13s} behind: {behind}"
    )


def _short_op(op: str) -> str:
    """The end of an HLO op name: what the model was doing (``.../dot_general``)."""
    parts = [p for p in op.split("/") if p]
    return "/".join(parts[-3:])
