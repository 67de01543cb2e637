"""Measuring `zpp tune`'s candidates (what to measure, and in which order,
is `zpp_jax.recipes.tune`'s): compiling each step, timing it on CPU
devices or reading XLA's estimate of it for GPUs, and each setting's
gradient error on one real batch."""

from __future__ import annotations

import importlib
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.recipes.tune import (
    Candidate,
    Link,
    TuneConfig,
    candidates,
    choose,
    link_bound_s,
    numerics_key,
    refinements,
    within_error,
)


def model_builder(cfg: TuneConfig, arch_preset: str | None = None) -> tuple[Callable, int]:
    """(A function that builds the model, its sequence length). `arch_preset`
    replaces `cfg.model` and its length (the GPU target's numerics run on
    ``tiny``)."""
    if cfg.entry is not None and arch_preset is None:
        module, _, function = cfg.entry.partition(":")
        try:
            build = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"--entry {cfg.entry!r}: {e}") from None
        if cfg.seq_len is None:
            raise UsageError("--entry needs --seq: the model's sequence length")
        return build, cfg.seq_len
    from zpp_jax.models import preset

    # The tiny stand-in keeps its own length: it measures numerics, not speed.
    seq = {"seq_len": cfg.seq_len} if cfg.seq_len and arch_preset is None else {}
    model, model_class = preset(cfg.arch, arch_preset or cfg.model, **seq)
    return (lambda: model_class(model, nnx.Rngs(0))), model.seq_len


def real_batch(batch: int, seq: int) -> dict:
    """One batch of the default corpus (bytes of Python's own sources), on
    the host: the same in every process."""
    from zpp_jax.data import TokenDataset, stdlib_corpus

    data = TokenDataset(stdlib_corpus(max(4 << 20, 4 * batch * (seq + 1))), seq)
    return data.batch("train", 0, batch, seed=0)


def parameter_count(build: Callable) -> int:
    abstract = nnx.eval_shape(build)
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def measure_cpu(trainer, batch: dict, steps: int, warmup: int) -> dict:
    """Compile the step once, report it, and time `steps` of it after
    `warmup` (the median, in seconds)."""
    from zpp_jax.analysis.report import compile_with_estimate, report_of
    from zpp_jax.data.loader import host_to_global

    placed = host_to_global(batch, trainer.batch_sharding())
    compiled, estimate = compile_with_estimate(trainer, placed)
    report = report_of(trainer, compiled, estimate)
    state, times = trainer.init(), []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = compiled(state, placed)
        float(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {**_row(report), "step_s": statistics.median(times), "times_s": times}


def measure_target(trainer, batch: dict) -> dict:
    """XLA's estimate of the step compiled for the GPU mesh (nothing runs)."""
    from zpp_jax.analysis import step_report

    structs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    report = step_report(trainer, structs)
    estimate = report["estimate"]
    if estimate is None:
        return {**_row(report), "step_s": None, "note": report["estimate_withheld"]}
    exposed = sum(estimate["exposed_us"].values()) / 1e6
    return {**_row(report), "step_s": estimate["step_us"] / 1e6, "exposed_s": exposed}


def _row(report: dict) -> dict:
    keys = ("cross_node_bytes", "intra_node_bytes", "peak_memory_bytes", "state_bytes")
    return {k: report[k] for k in keys}


def gradient(config: ZeroPPConfig, build: Callable, mesh, batch: dict, compute_dtype):
    """The gradient of the default loss on `batch` with `config`, in the
    parameters' own shapes."""
    from zpp_jax.data.loader import host_to_global
    from zpp_jax.mesh import batch_sharding
    from zpp_jax.shard import shard
    from zpp_jax.sharded import grad
    from zpp_jax.train import next_token_loss

    model = shard(build(), mesh, config, compute_dtype=compute_dtype)
    placed = host_to_global(batch, batch_sharding(mesh))
    return nnx.jit(grad(next_token_loss))(model, placed)


@jax.jit
def relative_error(got, exact) -> jax.Array:
    """‖got - exact‖ / ‖exact‖ over every leaf."""
    diff = sum(jnp.sum((a - b).astype(jnp.float32) ** 2) for a, b in _pairs(got, exact))
    norm = sum(jnp.sum(b.astype(jnp.float32) ** 2) for _, b in _pairs(got, exact))
    return jnp.sqrt(diff / norm)


def _pairs(got, exact):
    return zip(jax.tree.leaves(got), jax.tree.leaves(exact), strict=True)


class Progress:
    """A bar over the compiles on stderr (process 0, unless quiet)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and jax.process_index() == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="zpp tune: compiles", file=sys.stderr)

    def step(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(name)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Tuner:
    """One `zpp tune` run: the model, the mesh, the batch, and the rows
    measured so far (one per candidate, measured or why not)."""

    def __init__(self, cfg: TuneConfig, mesh, cpu_mesh) -> None:
        self.cfg, self.mesh, self.cpu_mesh = cfg, mesh, cpu_mesh
        self.link = Link.parse(cfg.link) if cfg.link else None
        self.build, self.seq = model_builder(cfg)
        self.params = parameter_count(self.build)
        self.batch = real_batch(cfg.batch, self.seq)
        self.rows: list[dict] = []
        self.compiles = 0
        self.progress = Progress(cfg.budget, cfg.progress)
        self._errors: dict = {}  # numerics_key -> gradient error
        self._exact = None  # the exact gradient, once computed

    def best_step(self) -> float:
        """The fastest step so far whose gradient error is within
        ``--max-grad-error``: what a candidate must beat."""
        bound = self.cfg.max_grad_error
        measured = [r for r in self.rows if r.get("step_s") is not None]
        eligible = [r["step_s"] for r in measured if within_error(r.get("grad_error"), bound)]
        return min(eligible, default=float("inf"))

    def run(self, group: list[Candidate]) -> None:
        """Measure `group` in the order of their link bounds, pruning those
        that cannot beat the fastest eligible step so far, and compiling
        none whose gradient error exceeds ``--max-grad-error`` (measured
        first: one gradient per distinct quantization)."""
        nodes, local = self.mesh.devices.shape
        bound = {c.name: 0.0 for c in group}
        if self.link is not None:
            bound = {
                c.name: link_bound_s(c.config, self.params, nodes, local, self.link) for c in group
            }
        for c in sorted(group, key=lambda c: bound[c.name]):
            row = {"name": c.name, "config": c.config, "bound_s": bound[c.name]}
            self.rows.append(row)
            if bound[c.name] >= self.best_step():
                row["note"] = "pruned: its link time alone exceeds the fastest step"
                continue
            row["grad_error"] = error = self.gradient_error(c.config)
            if not within_error(error, self.cfg.max_grad_error):
                limit = f"--max-grad-error {self.cfg.max_grad_error:g}"
                row["note"] = f"not compiled: gradient error {error:.2e} > {limit}"
            elif self.compiles >= self.cfg.budget:
                row["note"] = "not compiled: --budget spent"
            else:
                row.update(self.measure(c.config))
                self.compiles += 1
                self.progress.step(c.name)

    def measure(self, config: ZeroPPConfig) -> dict:
        from zpp_jax.train import Trainer

        links = None if self.link is None else self.link.link_model()
        kw = dict(compute_dtype=self.cfg.compute_dtype)
        if links is not None:
            kw["links"] = links
        if self.cfg.target == "cpu":
            trainer = Trainer(self.build(), optax.adamw(1e-3), self.mesh, config, **kw)
            return measure_cpu(trainer, self.batch, self.cfg.steps, self.cfg.warmup)
        abstract = nnx.eval_shape(self.build)
        trainer = Trainer(abstract, optax.adamw(1e-3), self.mesh, config, **kw)
        return measure_target(trainer, self.batch)

    def gradient_error(self, config: ZeroPPConfig) -> float | None:
        """`config`'s gradient error, one gradient per distinct quantization
        (on the GPU target: the architecture's tiny preset; None for an
        entry model there, whose size may not fit on CPU devices)."""
        if self.cfg.target != "cpu" and self.cfg.entry is not None:
            return None
        key = numerics_key(config)
        if key not in self._errors:
            build, batch = self._numerics_model()
            if self._exact is None:
                exact = ZeroPPConfig.zero3(comm_dtype=None)
                self._exact = gradient(exact, build, self.cpu_mesh, batch, self.cfg.compute_dtype)
            got = gradient(config, build, self.cpu_mesh, batch, self.cfg.compute_dtype)
            self._errors[key] = float(relative_error(got, self._exact))
        return self._errors[key]

    def _numerics_model(self) -> tuple[Callable, dict]:
        if self.cfg.target == "cpu":
            return self.build, self.batch
        build, seq = model_builder(self.cfg, arch_preset="tiny")
        return build, real_batch(self.cfg.batch, seq)


def tune(cfg: TuneConfig, mesh, cpu_mesh) -> dict:
    """Run `zpp tune` on `mesh` (CPU devices, or a GPU target mesh), its
    numerics on `cpu_mesh`; write the winner to ``cfg.out`` (process 0).
    Returns the rows, ranked, and the winner's."""
    out = pathlib.Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise UsageError(f"{out} exists: pass --overwrite to replace it, or another --out")
    tuner = Tuner(cfg, mesh, cpu_mesh)
    start = time.perf_counter()
    tuner.run(candidates(ZeroPPConfig(comm_dtype="bfloat16")))
    best = choose(tuner.rows, cfg.max_grad_error)
    tuner.run(refinements(Candidate(best["name"], best["config"])))
    tuner.progress.close()
    winner = choose(tuner.rows, cfg.max_grad_error)
    rows = sorted(tuner.rows, key=lambda r: (r.get("step_s") is None, r.get("step_s") or 0))
    took = time.perf_counter() - start
    if jax.process_index() == 0:
        about = {
            "tuned_by": "zpp tune",
            "setting": winner["name"],
            "step_s": winner["step_s"],
            "target": cfg.target,
            "mesh": list(mesh.devices.shape),
            "batch": cfg.batch,
            "seq": tuner.seq,
            "link": cfg.link,
            "max_grad_error": cfg.max_grad_error,
            "compiles": tuner.compiles,
            "seconds": took,
            "rows": [_summary(r) for r in rows],
        }
        winner["config"].to_file(out, about=about, overwrite=cfg.overwrite)
    return {"rows": rows, "winner": winner["name"], "seconds": took, "compiles": tuner.compiles}


def _summary(row: dict) -> dict:
    """A row as the config file's provenance keeps it (JSON, no config)."""
    keys = ("name", "step_s", "exposed_s", "grad_error", "bound_s", "note")
    keys += ("cross_node_bytes", "intra_node_bytes", "peak_memory_bytes")
    return {k: row[k] for k in keys if row.get(k) is not None}


def table(result: dict, target: str) -> str:
    """The ranked rows as text: step (measured on CPU, XLA's estimate on a
    GPU target), exposed communication (the estimate's), bytes across
    nodes, peak memory, gradient error, and why a row was not measured."""
    step = "step (XLA's estimate)" if target != "cpu" else "step (median)"
    head = f"{'':2} {'setting':28} {step:>22} {'exposed':>9} {'cross-node MB':>14} "
    head += f"{'peak GB':>8} {'grad error':>10}"
    lines = [head]
    for i, r in enumerate(result["rows"]):
        if r.get("step_s") is None:
            lines.append(f"{'':2} {r['name']:28} {r.get('note', '')}")
            continue
        exposed = f"{r['exposed_s'] * 1e3:.1f} ms" if r.get("exposed_s") is not None else "-"
        error = f"{r['grad_error']:.2e}" if r.get("grad_error") is not None else "-"
        mark = "*" if r["name"] == result["winner"] else str(i + 1)
        lines.append(
            f"{mark:>2} {r['name']:28} {r['step_s'] * 1e3:19.1f} ms {exposed:>9} "
            f"{r['cross_node_bytes'] / 1e6:14.2f} {r['peak_memory_bytes'] / 1e9:8.3f} {error:>10}"
        )
    return "\n".join(lines)


def run_tune_command(cfg: TuneConfig) -> int:
    """`zpp tune` once its job is joined (or its devices emulated): the
    meshes, the run, the table on stdout (process 0)."""
    from zpp_jax.mesh import make_mesh

    if cfg.target == "cpu":
        mesh = cpu_mesh = make_mesh(cfg.nodes, cfg.local)
    else:
        from zpp_jax.analysis import target_mesh

        mesh = target_mesh(cfg.nodes, cfg.local, cfg.target_config)
        cpu_mesh = make_mesh(cfg.nodes, cfg.local)
    result = tune(cfg, mesh, cpu_mesh)
    if jax.process_index() == 0:
        print(table(result, cfg.target))
        print(
            f"zpp tune: {result['compiles']} compiles in {result['seconds']:.0f} s; "
            f"chose {result['winner']!r}, written to {cfg.out}"
        )
    return 0
