"""Measuring `zpp tune`'s candidates (what to measure, and in which order,
is `zpp_jax.recipes.tune`'s): compiling each step, timing it on CPU
devices or reading XLA's estimate of it for GPUs, and each setting's
gradient error on one real batch."""

from __future__ import annotations

import importlib
import itertools
import os
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
    measured_rows,
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


class TimedStep:
    """A training step compiled on CPU devices, and its training state,
    ready to be timed again (the state goes on training: the step donates
    it, and the model's parameters with it). Holds one training state."""

    def __init__(self, trainer, batch: dict) -> None:
        from zpp_jax.analysis.report import compile_with_estimate, report_of
        from zpp_jax.data.loader import host_to_global

        self.placed = host_to_global(batch, trainer.batch_sharding())
        self.compiled, estimate = compile_with_estimate(trainer, self.placed)
        self.report = report_of(trainer, self.compiled, estimate)
        self.state = trainer.init()

    def time(self, steps: int) -> list[float]:
        """Seconds each of `steps` steps took, as process 0 timed them (every
        process gets the same numbers, so that all make the same choices)."""
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.state, metrics = self.compiled(self.state, self.placed)
            float(metrics["loss"])
            times.append(time.perf_counter() - start)
        return agreed(times)


def agreed(times: list[float]) -> list[float]:
    """Process 0's `times`, in every process."""
    if jax.process_count() == 1 or not times:
        return times
    from jax.experimental import multihost_utils

    ours = jnp.asarray(times, jnp.float32)
    return [float(t) for t in multihost_utils.broadcast_one_to_all(ours)]


def measure_cpu(step: TimedStep, steps: int, warmup: int) -> dict:
    """Time `steps` of `step` after `warmup` (the median, in seconds)."""
    times = step.time(warmup + steps)[warmup:]
    return {**_row(step.report), "step_s": statistics.median(times), "times_s": times}


def measure_target(trainer, batch: dict) -> dict:
    """XLA's estimate of the step compiled for the GPU mesh (nothing runs)."""
    from zpp_jax.analysis import step_report

    structs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    report = step_report(trainer, structs)
    estimate = report["estimate"]
    if estimate is None:
        return {**_row(report), "step_s": None, "note": report["estimate_withheld"]}
    exposed = sum(estimate["exposed_us"].values()) / 1e6
    return {
        **_row(report),
        "step_s": estimate["step_us"] / 1e6,
        "exposed_s": exposed,
        "compute_s": estimate["compute_us"] / 1e6,
        "link_busy_s": {k: v / 1e6 for k, v in estimate["link_busy_us"].items()},
    }


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


def searched_degrees(cfg: TuneConfig) -> tuple[int, ...]:
    """The tensor-parallel degrees to search: --tp's, each checked against
    the model's heads (``all``: those that divide them; an entry model's
    are its own to check)."""
    degrees = cfg.degrees()
    if cfg.entry is not None:
        return degrees
    from zpp_jax.models import preset
    from zpp_jax.models.names import check_heads

    model, _ = preset(cfg.arch, cfg.model)
    if cfg.tp != "all":
        for t in degrees:
            check_heads(model, t)
        return degrees
    fits = []
    for t in degrees:
        try:
            check_heads(model, t)
        except UsageError:
            continue
        fits.append(t)
    return tuple(fits)


class Tuner:
    """One `zpp tune` run: the model, a mesh per tensor-parallel degree, the
    batch, and the rows measured so far (one per candidate, measured or
    why not). `memory_bytes`: one device's memory, where a step must fit
    (the GPU target's; None: not checked)."""

    def __init__(self, cfg: TuneConfig, meshes: dict, cpu_mesh, memory_bytes=None) -> None:
        self.cfg, self.meshes, self.cpu_mesh = cfg, meshes, cpu_mesh
        self.memory_bytes = memory_bytes
        self.link = Link.parse(cfg.link) if cfg.link else None
        self.build, self.seq = model_builder(cfg)
        self.params = parameter_count(self.build)
        self.batch = real_batch(cfg.batch, self.seq)
        self.rows: list[dict] = []
        self.compiles = 0
        self.progress = Progress(cfg.budget, cfg.progress)
        self._errors: dict = {}  # numerics_key -> gradient error
        self._exact = None  # the exact gradient, once computed
        self._kept: dict[str, tuple] = {}  # name -> (row, TimedStep), to confirm

    def best_step(self) -> float:
        """The fastest step so far whose gradient error is within
        ``--max-grad-error``: what a candidate must beat."""
        bound = self.cfg.max_grad_error
        measured = measured_rows(self.rows)
        eligible = [r["step_s"] for r in measured if within_error(r.get("grad_error"), bound)]
        return min(eligible, default=float("inf"))

    def run(self, group: list[Candidate]) -> None:
        """Measure `group` in the order of their link bounds, pruning those
        that cannot beat the fastest eligible step so far, and compiling
        none whose gradient error exceeds ``--max-grad-error`` (measured
        first: one gradient per distinct quantization). Once ``--budget``
        compiles are spent, the rest are listed unmeasured: no gradient is
        computed for a setting that will not be compiled."""
        nodes, local = self.cfg.nodes, self.cfg.local
        bound = {c.label: 0.0 for c in group}
        if self.link is not None:
            bound = {
                c.label: link_bound_s(c.config, self.params, nodes, local, self.link, c.tp)
                for c in group
            }
        for c in sorted(group, key=lambda c: bound[c.label]):
            row = {"name": c.label, "setting": c.name, "tp": c.tp, "config": c.config}
            row["bound_s"] = bound[c.label]
            self.rows.append(row)
            if bound[c.label] >= self.best_step():
                row["note"] = "pruned: its link time alone exceeds the fastest step"
                continue
            if self.compiles >= self.cfg.budget:
                row["note"] = "not compiled: --budget spent"
                continue
            row["grad_error"] = error = self.gradient_error(c.config)
            if not within_error(error, self.cfg.max_grad_error):
                limit = f"--max-grad-error {self.cfg.max_grad_error:g}"
                row["note"] = f"not compiled: gradient error {error:.2e} > {limit}"
            else:
                self.measure(row)
                self.compiles += 1
                self.progress.step(c.name)

    def measure(self, row: dict) -> None:
        """Compile `row`'s setting and add what was measured to `row`."""
        from zpp_jax.train import Trainer

        links = None if self.link is None else self.link.link_model()
        kw = dict(compute_dtype=self.cfg.compute_dtype)
        if links is not None:
            kw["links"] = links
        build, mesh = self._build_at(row["tp"]), self.meshes[row["tp"]]
        if row["tp"] > 1:
            from zpp_jax.models.names import TENSOR_PARALLEL_RULES

            kw["rules"] = TENSOR_PARALLEL_RULES
        if self.cfg.target != "cpu":
            abstract = nnx.eval_shape(build)
            trainer = Trainer(abstract, optax.adamw(1e-3), mesh, row["config"], **kw)
            row.update(measure_target(trainer, self.batch))
            mark_unfit(row, self.memory_bytes)
            return
        trainer = Trainer(build(), optax.adamw(1e-3), mesh, row["config"], **kw)
        step = TimedStep(trainer, self.batch)
        row.update(measure_cpu(step, self.cfg.steps, self.cfg.warmup))
        self._keep(row, step)

    def _build_at(self, tp: int) -> Callable:
        """The model builder at degree `tp`: a reference model gets its
        dimensions' logical names (`name_axes`) for the rules to split; an
        entry model carries its own."""
        if tp == 1 or self.cfg.entry is not None:
            return self.build
        from zpp_jax.models.names import name_axes

        return lambda: name_axes(self.build())

    def _keep(self, row: dict, step: TimedStep) -> None:
        """Keep `step` while it is among the ``confirm`` fastest eligible."""
        if within_error(row.get("grad_error"), self.cfg.max_grad_error):
            self._kept[row["name"]] = (row, step)
        ranked = sorted(self._kept, key=lambda name: self._kept[name][0]["step_s"])
        for name in ranked[self.cfg.confirm :]:
            del self._kept[name]

    def confirm(self) -> None:
        """Time the kept steps again, side by side: ``steps`` rounds, each
        one step of every kept setting in turn (the order rotating), after
        ``warmup`` each. Their rows' ``step_s`` becomes the median of these
        (the search's is kept as ``search_step_s``): a choice among settings
        a few percent apart is then made on times taken under the same load,
        not minutes apart. Holds the kept settings' training states (up to
        ``confirm`` of them) until the search ends."""
        kept = list(self._kept.values())
        self._kept = {}
        if len(kept) < 2:
            return
        times: list[list[float]] = [[] for _ in kept]
        for _, step in kept:
            step.time(self.cfg.warmup)
        for i in range(self.cfg.steps):
            for j in [(i + k) % len(kept) for k in range(len(kept))]:
                times[j] += kept[j][1].time(1)
        for (row, _), timed in zip(kept, times, strict=True):
            row["search_step_s"], row["confirmed"] = row["step_s"], True
            row["step_s"] = statistics.median(timed)

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


def mark_unfit(row: dict, memory_bytes: int | None) -> None:
    """Mark a measured `row` as not fitting (``fits`` False, and a note)
    where its peak exceeds `memory_bytes`, one device's memory (None: any
    fits): `choose` then passes it over."""
    peak = row["peak_memory_bytes"]
    if memory_bytes is not None and peak > memory_bytes:
        row["fits"] = False
        row["note"] = f"does not fit: peak {peak / 1e9:.1f} GB > {memory_bytes / 1e9:.1f} GB"


def check_out(out: pathlib.Path, overwrite: bool) -> None:
    """Raise UsageError unless the winner can be written to `out`: checked
    before the search, not after it."""
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory: name the file to write")
    if out.exists() and not overwrite:
        raise UsageError(f"{out} exists: pass --overwrite to replace it, or another --out")
    parent = out.parent if str(out.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise UsageError(f"--out {out}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--out {out}: the directory {parent} is not writable")


def tune(cfg: TuneConfig, meshes: dict, cpu_mesh, memory_bytes: int | None = None) -> dict:
    """Run `zpp tune` on `meshes` (per tensor-parallel degree: CPU devices,
    or a GPU target mesh), its numerics on `cpu_mesh`; write the winner to
    ``cfg.out`` (process 0). Every degree's candidates are measured in one
    order, by their link bounds; the fastest eligible setting is refined at
    its degree. Returns the rows, ranked, and the winner's."""
    out = pathlib.Path(cfg.out)
    check_out(out, cfg.overwrite)
    tuner = Tuner(cfg, meshes, cpu_mesh, memory_bytes)
    start = time.perf_counter()
    base = ZeroPPConfig(comm_dtype="bfloat16")
    # Each setting at every degree next to each other, so that of settings
    # whose bounds tie the budget spends its compiles across the degrees.
    per_degree = [candidates(base, t) for t in meshes]
    tuner.run([c for row in itertools.zip_longest(*per_degree) for c in row if c is not None])
    best = choose(tuner.rows, cfg.max_grad_error)
    tuner.run(refinements(Candidate(best["setting"], best["config"], best["tp"])))
    tuner.progress.close()
    tuner.confirm()
    winner = choose(tuner.rows, cfg.max_grad_error)
    rows = sorted(tuner.rows, key=rank)
    took = time.perf_counter() - start
    if jax.process_index() == 0:
        about = {
            "tuned_by": "zpp tune",
            "setting": winner["name"],
            "tp": winner["tp"],
            "step_s": winner["step_s"],
            "target": cfg.target,
            "mesh": list(meshes[winner["tp"]].devices.shape),
            "batch": cfg.batch,
            "seq": tuner.seq,
            "link": cfg.link,
            "max_grad_error": cfg.max_grad_error,
            "compiles": tuner.compiles,
            "seconds": took,
            "rows": [_summary(r) for r in rows],
        }
        winner["config"].to_file(out, about=about, overwrite=cfg.overwrite)
    return {
        "rows": rows,
        "winner": winner["name"],
        "tp": winner["tp"],
        "seconds": took,
        "compiles": tuner.compiles,
    }


def rank(row: dict) -> tuple:
    """The table's order: the settings timed side by side first, then the
    rest measured, then those not measured; fastest first in each."""
    return (row.get("step_s") is None, not row.get("confirmed"), row.get("step_s") or 0)


def _summary(row: dict) -> dict:
    """A row as the config file's provenance keeps it (JSON, no config)."""
    keys = ("name", "tp", "step_s", "search_step_s", "confirmed", "exposed_s", "grad_error")
    keys += ("bound_s", "note", "compute_s", "link_busy_s")
    keys += ("cross_node_bytes", "intra_node_bytes", "peak_memory_bytes")
    return {k: row[k] for k in keys if row.get(k) is not None}


def table(result: dict, target: str) -> str:
    """The ranked rows as text: step (measured on CPU, the side-by-side
    median for the settings confirmed; XLA's estimate on a GPU target),
    exposed communication (the estimate's), bytes across nodes, peak
    memory, gradient error, and why a row was not measured."""
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
            + _links_and_compute(r)
            + (f"   {r['note']}" if r.get("note") else "")
        )
    again = sum(bool(r.get("confirmed")) for r in result["rows"])
    if again:
        lines.append(f"(the first {again} timed again side by side, and chosen among)")
    return "\n".join(lines + degree_lines(result))


def degree_lines(result: dict) -> list[str]:
    """Why the degree: each searched degree's fastest measured setting, its
    step and what bounds it (the kernels alone, each link's busy time, the
    peak); none where one degree was searched."""
    degrees = sorted({r.get("tp", 1) for r in result["rows"]})
    if len(degrees) < 2:
        return []
    lines = ["by tensor-parallel degree (the fastest measured of each):"]
    for t in degrees:
        rows = [r for r in result["rows"] if r.get("tp", 1) == t]
        measured = [r for r in rows if r.get("step_s") is not None]
        if not measured:
            lines.append(f"  tp {t}: none measured (pruned, or over the budget)")
            continue
        r = min(measured, key=lambda r: (r.get("fits") is False, r["step_s"]))
        mark = "  <- chosen" if t == result["tp"] else ""
        fits = "" if r.get("fits", True) else ", does not fit"
        lines.append(
            f"  tp {t}: {r['name']} {r['step_s'] * 1e3:.1f} ms, peak "
            f"{r['peak_memory_bytes'] / 1e9:.3f} GB{fits}{_links_and_compute(r)}{mark}"
        )
    return lines


def _links_and_compute(row: dict) -> str:
    """A GPU target's row: the kernels alone and each link's busy time."""
    if row.get("compute_s") is None:
        return ""
    busy = "".join(f", {k} {v * 1e3:.1f} ms" for k, v in row["link_busy_s"].items())
    return f"   compute {row['compute_s'] * 1e3:.1f} ms{busy}"


def run_tune_command(cfg: TuneConfig) -> int:
    """`zpp tune` once its job is joined (or its devices emulated): the
    meshes, the run, the table on stdout (process 0)."""
    from zpp_jax.mesh import make_mesh

    check_out(pathlib.Path(cfg.out), cfg.overwrite)
    degrees = searched_degrees(cfg)
    if not degrees:
        raise UsageError(f"--tp all: no degree that divides --local {cfg.local} divides the heads")
    cpu_mesh = make_mesh(cfg.nodes, cfg.local)
    memory = None
    if cfg.target == "cpu":
        meshes = {t: make_mesh(cfg.nodes, cfg.local // t, model=t) for t in degrees}
    else:
        from zpp_jax.analysis import target_mesh
        from zpp_jax.analysis.target import device_memory_bytes

        meshes = {t: target_mesh(cfg.nodes, cfg.local, cfg.target_config, t) for t in degrees}
        memory = device_memory_bytes(cfg.target_config)
    result = tune(cfg, meshes, cpu_mesh, memory)
    if jax.process_index() == 0:
        print(table(result, cfg.target))
        train = f"zpp train --config {cfg.out}"
        train += f" --tp {result['tp']}" if result["tp"] > 1 else ""
        print(
            f"zpp tune: {result['compiles']} compiles in {result['seconds']:.0f} s; "
            f"chose {result['winner']!r}, written to {cfg.out}; train it with: {train}"
        )
    return 0
