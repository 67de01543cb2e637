"""Train a reference language model with ZeRO++ on your text: what `zpp train` runs.

Three parts, each its own function:

* `build(cfg)`: the data (`zpp_jax.recipes.corpus`: text or token files, the
  tokenizer), the model (`--arch gpt` or `llama`), the
  optimizer, the `Trainer`, the checkpointer, and the state (fresh, or
  restored with ``resume``);
* `loop(job)`: the steps, with evaluation and checkpoints; yields a record
  per step;
* `Output`: what a run writes: metrics (JSON lines), progress bar and log
  lines, the loss plot; one process writes in a multi-process job.

`run(cfg)` is the three together. A run is reproducible bit for bit from its
seed and resumable from its checkpoints at the exact batch where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx

from zpp_jax.analysis import summarize
from zpp_jax.analysis.report import state_bytes_per_device
from zpp_jax.checkpoint import Checkpointer
from zpp_jax.data import BatchLoader, TokenDataset, local_rows
from zpp_jax.data.examples import ExampleDataset
from zpp_jax.data.tokenizer import bpe_size
from zpp_jax.errors import INT32_MAX, UsageError
from zpp_jax.mesh import make_mesh
from zpp_jax.models import ARCHITECTURES, GPTConfig, Llama, LlamaConfig, preset
from zpp_jax.models.names import TENSOR_PARALLEL_RULES, check_heads, name_axes
from zpp_jax.pipeline.planner import folded
from zpp_jax.preemption import Stopped, StopRequest
from zpp_jax.recipes import corpus, runs
from zpp_jax.recipes.config import INIT_SEQ, RunConfig, parse_slices
from zpp_jax.recipes.optimizer import make_optimizer, with_schedule_of
from zpp_jax.train import Trainer

# -- build ----------------------------------------------------------------------


def model_config(cfg: RunConfig) -> GPTConfig | LlamaConfig:
    """The run's model: `arch` at preset `model`, with the tokenizer's
    vocabulary; with `init`, the checkpoint's own (its vocabulary kept)."""
    if cfg.init is not None:
        from zpp_jax.hf import llama_config, read_config

        checkpoint = read_config(cfg.init)
        seq_len = cfg.seq_len
        if seq_len is None:  # the checkpoint's default length, capped
            seq_len = min(llama_config(checkpoint).seq_len, INIT_SEQ)
        return llama_config(checkpoint, seq_len, cfg.compute_dtype)
    model_cfg, _ = preset(cfg.arch, cfg.model, dtype=cfg.compute_dtype)
    if cfg.vocab_size is not None:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=cfg.vocab_size)
    if cfg.seq_len is not None:
        model_cfg = dataclasses.replace(model_cfg, seq_len=cfg.seq_len)
    return model_cfg


def make_model(cfg: RunConfig) -> nnx.Module:
    """The run's model, its parameters drawn from `cfg.seed`, or with
    `init` read from the checkpoint. Drawn by one compiled program on the
    default device, where eagerly each initializer would be a program of
    its own to compile: the values eager construction draws, to the last
    bit of float32 (XLA may fuse the initializers' arithmetic otherwise).
    The seed's key is an argument of that program, not a constant in it, so
    runs that differ in their seed compile it once."""
    model_cfg = model_config(cfg)
    if cfg.init is not None:
        from zpp_jax import hf

        return hf.load(cfg.init, dtype=model_cfg.dtype, seq_len=model_cfg.seq_len)
    cls = model_class(cfg)
    return nnx.jit(lambda key: cls(model_cfg, nnx.Rngs(key)))(jax.random.key(cfg.seed))


def model_class(cfg: RunConfig) -> type:
    return Llama if cfg.init is not None else ARCHITECTURES[cfg.arch][1]


def model_name(cfg: RunConfig) -> str:
    """What the log calls the model."""
    return f"checkpoint {cfg.init}" if cfg.init is not None else f"{cfg.arch} {cfg.model}"


def make_trainer(cfg: RunConfig, model: nnx.Module | None = None) -> Trainer:
    """The model (default: `make_model`), optimizer, mesh and `Trainer` of
    a run; with `cfg.lora`, LoRA adapters over the frozen model."""
    if cfg.tp > 1:
        check_heads(model_config(cfg), cfg.tp)
    model = make_model(cfg) if model is None else model
    freeze = None
    if cfg.lora is not None:
        from zpp_jax.lora import FROZEN, add_lora

        model = add_lora(model, cfg.lora, lora_targets(cfg), seed=cfg.seed, alpha=cfg.lora_alpha)
        freeze = FROZEN
    if cfg.tp > 1:
        name_axes(model)  # the heads, MLP and vocabulary over the model axis
    return Trainer(
        model,
        make_optimizer(cfg),
        make_mesh(cfg.nodes, cfg.data_local, model=cfg.tp),
        cfg.zero,
        grad_accum=cfg.grad_accum,
        max_grad_norm=cfg.clip,
        freeze=freeze,
        rules=TENSOR_PARALLEL_RULES if cfg.tp > 1 else None,
    )


def lora_targets(cfg: RunConfig) -> tuple[str, ...]:
    return tuple(name.strip() for name in cfg.lora_targets.split(",") if name.strip())


def choose_slices(cfg: RunConfig, model_cfg: GPTConfig) -> tuple[tuple[int, ...], str]:
    """The run's token slicing and how it was chosen (for the log)."""
    from zpp_jax.pipeline import AnalyticCost, load_cost, plan_tokens, uniform_slicing
    from zpp_jax.pipeline.planner import auto_granularity

    seq, spec = model_cfg.seq_len, parse_slices(cfg.slices)
    if isinstance(spec, tuple):
        if sum(spec) != seq:
            raise UsageError(
                f"--slices {cfg.slices} add up to {sum(spec)} tokens; the sequences have {seq}"
            )
        return spec, "given"
    if isinstance(spec, int):
        if spec > seq:
            raise UsageError(f"--slices {spec}: more slices than the {seq} tokens of a sequence")
        return uniform_slicing(seq, spec), f"{spec} equal slices"
    per_stage = model_cfg.n_layers // cfg.stages
    if cfg.cost:
        cost, source = load_cost(cfg.cost), f"cost model {cfg.cost}"
    else:
        cost = AnalyticCost(
            hidden=model_cfg.d_model,
            layers=per_stage,
            ffn=model_cfg.d_ff,
            matmul_weights=_matmul_weights(model_cfg),
        )
        source = "analytic cost model"
    granularity = auto_granularity(seq)
    rows = cfg.batch // (cfg.nodes * cfg.local)
    plan = plan_tokens(seq, cfg.stages, cost, granularity, rows, objective="lockstep")
    return plan.slices, f"planned ({source}, granularity {granularity} tokens)"


def _matmul_weights(model_cfg: GPTConfig | LlamaConfig) -> int:
    """Weights per layer that multiply each token (the cost model's dense term)."""
    d, f = model_cfg.d_model, model_cfg.d_ff
    if isinstance(model_cfg, GPTConfig):
        return 4 * d * d + 2 * d * f
    kv = model_cfg.n_kv_heads * model_cfg.head_dim
    return 2 * d * d + 2 * d * kv + 3 * d * f  # q and o, k and v, SwiGLU


def make_pipeline_trainer(cfg: RunConfig, slices: tuple[int, ...]):
    """The run's model and optimizer as a token pipeline of `cfg.stages`
    stages of nodes x local devices each."""
    from zpp_jax.mesh import make_pipeline_mesh
    from zpp_jax.pipeline import PipelineTrainer

    return PipelineTrainer(
        make_model(cfg),
        make_optimizer(cfg),
        make_pipeline_mesh(cfg.stages, cfg.nodes, cfg.local),
        slices,
        cfg.zero if cfg.stage_zero else None,
        max_grad_norm=cfg.clip,
    )


@dataclasses.dataclass
class Job:
    """Everything `loop` needs: built once, then stepped."""

    cfg: RunConfig
    model_cfg: Any
    data: TokenDataset
    trainer: Trainer
    checkpointer: Checkpointer | None
    state: Any
    position: int  # batches consumed: where the run resumes
    identity: dict  # saved with each checkpoint, checked on resume
    saved_at: int = 0  # the position of the newest checkpoint (0: none)
    train_step: Any = None
    eval_step: Any = None
    slicing: str = ""  # the token pipeline's slices, and how they were chosen
    corpus: str = ""  # where the tokens come from, for the log
    val_bytes_per_token: float = 1.0  # of the validation split: for bits per byte
    cross_node_bytes: float = 0.0
    intra_node_bytes: float = 0.0
    state_bytes: int = 0  # of the model and optimizer state, per device

    def batches(self, split: str, start: int, stop: int) -> BatchLoader:
        """Batches start..stop-1 of a split on the mesh, read ahead by grain
        threads; this process reads only its own rows."""
        return BatchLoader(
            self.data,
            split,
            self.cfg.batch,
            self.cfg.seed,
            self.trainer.batch_sharding(),
            start,
            stop,
        )


def check_settings(cfg: RunConfig) -> None:
    """What can be checked of a run before any file is touched: its paths
    (`runs.check_paths`), the model preset, the tokens of a step, the
    split of the layers into stages, and LoRA's rank and targets (on the
    model's shapes).

    Raises:
      UsageError: naming the setting and what would work.
    """
    runs.check_paths(cfg)
    model_cfg = model_config(cfg)
    tokens = cfg.batch * model_cfg.seq_len
    if tokens > INT32_MAX:
        raise UsageError(
            f"--batch {cfg.batch} x {model_cfg.seq_len} tokens = {tokens:,} tokens a step, "
            f"more than int32 indexing reaches ({INT32_MAX:,}); use a smaller --batch or --seq"
        )
    if cfg.stages > 1 and model_cfg.n_layers % cfg.stages:
        raise UsageError(
            f"--stages {cfg.stages} does not divide the model's {model_cfg.n_layers} "
            "layers; choose a number of stages that divides the layer count"
        )
    _check_host_memory(cfg, model_cfg.seq_len)
    if cfg.lora is not None:
        from zpp_jax.lora import add_lora

        abstract = nnx.eval_shape(lambda: model_class(cfg)(model_cfg, nnx.Rngs(0)))
        add_lora(abstract, cfg.lora, lora_targets(cfg), seed=cfg.seed, alpha=cfg.lora_alpha)


def _check_host_memory(cfg: RunConfig, seq_len: int) -> None:
    """On CPU devices, refuse a step whose logits alone (fp32, for this
    process's rows of one micro-batch, over the smallest vocabulary the
    tokenizer can give) exceed the host's memory: it could never run, and
    would swap the machine first."""
    if jax.default_backend() != "cpu":
        return
    vocab = bpe_size(cfg.tokenizer) or 256
    rows = cfg.batch // (jax.process_count() * cfg.grad_accum) or 1
    logits = rows * seq_len * vocab * 4
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if logits > memory:
        raise UsageError(
            f"--batch {cfg.batch} x {seq_len} tokens x {vocab} ids: the logits alone take "
            f"{logits:,} B a step in this process, more than the host's {memory:,} B of "
            "memory; use a smaller --batch or --seq, or more --grad-accum"
        )


def build(cfg: RunConfig, log=print) -> Job:
    """Data, model, trainer, checkpointer and state; the steps compiled
    (unless a resumed run has no step left: `Job.train_step` stays None).
    `run` checks the settings first (`check_settings`) and holds the
    outputs' lock (`runs.OutputLock`) around it."""
    runs.claim(cfg, log, delete=jax.process_index() == 0)
    text = corpus.load(cfg, log)
    cfg = dataclasses.replace(cfg, vocab_size=text.tokenizer.vocab_size)
    model_cfg = model_config(cfg)
    data = text.dataset(model_cfg.seq_len, model_cfg.vocab_size)
    if jax.process_index() == 0 and not cfg.resume:
        corpus.save_tokenizer(cfg, text.tokenizer)
        runs.save_model_config(cfg, model_cfg)
    slicing = ""
    if cfg.stages > 1:
        slices, how = choose_slices(cfg, model_cfg)
        trainer = make_pipeline_trainer(cfg, slices)
        slicing = f"{len(slices)} slices ({how}): {folded(slices)}"
    else:
        trainer = make_trainer(cfg)
    trainer.check_batch_size(cfg.batch)
    checkpointer = Checkpointer(cfg.ckpt_dir) if cfg.ckpt_dir else None
    state, position = None, 0
    run_identity = runs.identity(
        cfg, text.fingerprint, text.tokenizer.fingerprint(), _init_fingerprint(cfg)
    )
    if cfg.resume:
        restored = runs.restore_latest_intact(
            checkpointer, trainer.abstract_state(), run_identity, log
        )
        if restored is None:
            log(f"--resume: no checkpoint in {cfg.ckpt_dir}; starting a new run")
        else:
            state, meta = restored
            state = with_schedule_of(state, cfg)  # the schedule follows this run's --steps
            position = meta["data_position"]
            if meta["residuals_reset"]:
                log(
                    f"--resume: checkpoint {position} was saved on a {_mesh_text(meta['mesh'])} "
                    f"mesh, this run is on {cfg.nodes} x {cfg.local}: the error-feedback residuals "
                    "restart from zero (the next steps' gradients carry no rounding error forward)"
                )
            if position > cfg.steps:
                raise UsageError(
                    f"--resume: checkpoint {position} in {cfg.ckpt_dir} is past --steps "
                    f"{cfg.steps}; pass --steps above {position} to train on"
                )
            if position == cfg.steps:
                log(f"--resume: checkpoint {position} is the last step (--steps {cfg.steps})")
    if state is None:  # a resumed run never initializes a state it would discard
        state = trainer.init()
    job = Job(cfg, model_cfg, data, trainer, checkpointer, state, position, run_identity)
    job.saved_at = position
    job.state_bytes = state_bytes_per_device(state)
    job.slicing = slicing
    job.val_bytes_per_token = corpus.bytes_per_token(data, text.tokenizer)
    rows = local_rows(trainer.batch_sharding(), (cfg.batch, model_cfg.seq_len))
    job.corpus = _describe_data(cfg, text, data, len(rows), log)
    if jax.process_count() > 1:  # every process says what it reads, even with --quiet
        print(
            f"zpp train: process {jax.process_index()} of {jax.process_count()} reads rows "
            f"{_ranges(rows)} of each batch of {cfg.batch}",
            file=sys.stderr,
            flush=True,
        )
    if position == cfg.steps:  # a resumed run with nothing left to train compiles nothing
        return job
    first = {split: next(job.batches(split, 0, 1)) for split in ("train", "val")}
    if isinstance(trainer, Trainer):  # on GPUs, scheduled on `zpp.LinkModel`'s costs
        job.train_step = trainer.compile_step(first["train"])
    else:  # a PipelineTrainer: XLA's own estimate
        job.train_step = trainer.train_step.lower(state, first["train"]).compile()
    job.eval_step = trainer.eval_step.lower(state, first["val"]).compile()
    moved = summarize(job.train_step.as_text(), cfg.local)
    job.cross_node_bytes, job.intra_node_bytes = moved.cross_node_bytes, moved.intra_node_bytes
    return job


def _describe_data(cfg: RunConfig, text, data, rows: int, log) -> str:
    """The data, for the log; warns of examples cut to the sequence length."""
    unit = "examples" if isinstance(data, ExampleDataset) else "tokens"
    if isinstance(data, ExampleDataset) and data.truncated["train"]:
        log(
            f"warning: {data.truncated['train']} training examples are longer than --seq "
            f"{data.seq_len} + 1 tokens and are cut there"
        )
    return (
        f"{text.source}, tokenizer {cfg.tokenizer_spec} ({text.tokenizer.vocab_size} ids); "
        f"{len(data.splits['train']):,} train and {len(data.splits['val']):,} validation "
        f"{unit}; this process reads {rows} of the {cfg.batch} rows of a batch"
    )


def _init_fingerprint(cfg: RunConfig) -> dict | None:
    if cfg.init is None:
        return None
    from zpp_jax.hf.files import fingerprint

    return fingerprint(pathlib.Path(cfg.init))


def _mesh_text(shape: dict | None) -> str:
    """``2 x 4`` for a saved mesh shape ``{"node": 2, "local": 4}``."""
    return " x ".join(str(v) for v in shape.values()) if shape else "another"


def _ranges(rows: list[int]) -> str:
    """0-3, 8-11 for [0, 1, 2, 3, 8, 9, 10, 11]."""
    out, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        out.append(f"{rows[i]}-{rows[j]}" if j > i else str(rows[i]))
        i = j + 1
    return ", ".join(out)


# -- loop -------------------------------------------------------------------------


def loop(job: Job, stop: StopRequest | None = None) -> Iterator[dict]:
    """Train from `job.position` to `cfg.steps`; yields each step's record
    (`step`, `loss`, `grad_norm`, `skipped`, `tokens_per_s`,
    `cross_node_bytes`, `state_bytes_per_device`: the bytes of the model and
    optimizer state one device holds, `data_wait_s`: the time the step
    waited for its batch, and `val_loss` / `val_bpb` (bits per byte) where
    evaluated). Checkpoints are numbered by data position, which every step
    advances.

    Before each step it asks `stop` (all processes agree on the answer);
    once a signal was received it saves a checkpoint of the steps done
    since the last one and raises `Stopped`.

    A step's record is yielded before its checkpoint is saved, so a consumer
    that writes it has it on disk first. A run killed between the two leaves
    a record past the newest checkpoint, which resume cuts
    (`runs.cut_metrics`); the other order could leave a checkpoint whose
    step was never recorded, and a resumed run would skip that step."""
    cfg = job.cfg
    tokens_per_step = cfg.batch * job.model_cfg.seq_len
    batches = job.batches("train", job.position, cfg.steps)
    while job.position < cfg.steps:
        signum = stop.agreed() if stop is not None else 0
        if signum:
            raise Stopped(signum, job.position, _save_on_stop(job))
        start = time.perf_counter()
        batch = next(batches)
        waited = time.perf_counter() - start
        job.state, metrics = job.train_step(job.state, batch)
        loss = float(metrics["loss"])
        elapsed = time.perf_counter() - start
        job.position += 1
        record = {
            "step": job.position,
            "loss": loss,
            "grad_norm": float(metrics["grad_norm"]),
            "skipped": int(metrics["skipped"]),
            "tokens_per_s": tokens_per_step / elapsed,
            "cross_node_bytes": job.cross_node_bytes,
            "state_bytes_per_device": job.state_bytes,
            "data_wait_s": waited,
        }
        last = job.position == cfg.steps
        if (cfg.eval_every and job.position % cfg.eval_every == 0) or last:
            record["val_loss"] = evaluate(job)
            bpb = corpus.bits_per_byte(record["val_loss"], job.val_bytes_per_token)
            record.update({} if bpb is None else {"val_bpb": bpb})
        yield record
        if job.checkpointer and ((cfg.ckpt_every and job.position % cfg.ckpt_every == 0) or last):
            save(job)


def save(job: Job) -> None:
    """Checkpoint the state at the job's position."""
    job.checkpointer.save(
        job.position, job.state, data_position=job.position, identity=job.identity
    )
    job.saved_at = job.position


def _save_on_stop(job: Job) -> str:
    """Save the steps done since the last checkpoint; says what was saved."""
    if job.checkpointer is None:
        return "no --ckpt-dir, nothing saved"
    if job.saved_at < job.position:
        save(job)
        return f"checkpoint {job.position} saved in {job.cfg.ckpt_dir}; continue with --resume"
    if job.position:
        return f"checkpoint {job.position} in {job.cfg.ckpt_dir} is current; continue with --resume"
    return "no step done, nothing to save"


def evaluate(job: Job) -> float:
    """Mean loss over the first `eval_batches` validation batches."""
    batches = job.batches("val", 0, job.cfg.eval_batches)
    return float(np.mean([float(job.eval_step(job.state, b)) for b in batches]))


# -- output -----------------------------------------------------------------------


class Output:
    """Metrics (`runs.MetricsSink`: a file, or a stream such as stdout),
    progress bar and log lines of a run (written by process 0 only), and
    the loss plot at the end (best effort: a failed plot is a warning)."""

    def __init__(self, cfg: RunConfig, position: int) -> None:
        self.cfg = cfg
        self.lead = jax.process_index() == 0
        self.metrics = None
        if cfg.metrics and self.lead:
            # A new run starts on an empty file (`runs.claim`); a resumed one
            # appends after the records up to its checkpoint.
            runs.cut_metrics(cfg.metrics, position)
            self.metrics = runs.MetricsSink(cfg.metrics)
        self.bar = None
        if cfg.progress and self.lead:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=position, desc="train", dynamic_ncols=True)

    def log(self, message: str) -> None:
        if self.cfg.progress and self.lead:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)

    def record(self, rec: dict) -> None:
        if self.metrics:
            self.metrics.write(json_record(rec))
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{rec['loss']:.4f}",
                tok_s=f"{rec['tokens_per_s']:,.0f}",
                xnode_MB=f"{rec['cross_node_bytes'] / 1e6:.2f}",
            )
            self.bar.update(1)

    def close(self, records: list[dict], finished: bool) -> None:
        """Close the metrics and the bar; for a `finished` run, log its
        last losses and draw the plot."""
        if self.metrics:
            self.metrics.close()
        if self.bar is not None:
            self.bar.close()
        if not finished:
            return
        if records:
            last = records[-1]
            val = f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else ""
            self.log(f"step {last['step']}: loss {last['loss']:.4f}{val}")
        if self.cfg.plot and self.lead:
            try:
                plot_losses(runs.metrics_file(self.cfg.metrics), self.cfg.plot, records)
            except OSError as e:
                _warn(f"warning: --plot {self.cfg.plot} not written: {e.strerror or e}")


def json_record(rec: dict) -> str:
    """`rec` as one line of strict JSON: a NaN or infinite value is written as
    null and its key listed under ``nonfinite``."""
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        rec = {**{k: (None if k in bad else v) for k, v in rec.items()}, "nonfinite": bad}
    return json.dumps(rec, allow_nan=False)


def plot_losses(metrics_file: pathlib.Path | None, path: str, records: list[dict]) -> None:
    """PNG of train and validation loss (all records of `metrics_file` if
    given), written whole or not at all: drawn to a temporary file beside
    `path`, then renamed over it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if metrics_file and metrics_file.exists():
        with open(metrics_file) as f:
            records = [json.loads(line) for line in f if line.strip()]

    def value(r, key):  # null (non-finite) in the file
        return float("nan") if r[key] is None else r[key]

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [value(r, "loss") for r in records], label="train", lw=1)
    val = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in val], [value(r, "val_loss") for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


# -- all three ----------------------------------------------------------------------


def _warn(message: str) -> None:
    """What a run must tell even with --quiet (checkpoints skipped or
    deleted), on process 0's stderr."""
    if jax.process_index() == 0:
        print(f"zpp train: {message}", file=sys.stderr, flush=True)


def run(cfg: RunConfig) -> list[dict]:
    """Train; returns the metrics records (also written to `cfg.metrics`).

    The run holds its checkpoint directory and metrics file for itself
    (`runs.OutputLock`) while it runs. SIGTERM or SIGINT stops it after
    the current step, with a checkpoint of the steps done (`loop`).

    Raises:
      UsageError: bad settings or paths, before anything is built.
      OutputError: an output could not be written (a full disk), or is
        in use by another run.
      Stopped: a signal stopped the run (its message says what was saved).
    """
    check_settings(cfg)
    with runs.hold_outputs(cfg), StopRequest() as stop:
        job = build(cfg, log=_warn)
        return _train(job, stop)


def _train(job: Job, stop: StopRequest) -> list[dict]:
    cfg = job.cfg
    output = Output(cfg, job.position)
    if job.position:
        output.log(f"resumed at batch {job.position} from {cfg.ckpt_dir}")
    model_cfg = job.model_cfg
    abstract = nnx.eval_shape(lambda: model_class(cfg)(model_cfg, nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    mesh = (
        f"{cfg.nodes} x {cfg.local}"
        if cfg.tp == 1
        else f"{cfg.nodes} x {cfg.data_local} x tp {cfg.tp}"
    )
    if cfg.stages > 1:
        zero = cfg.zero if cfg.stage_zero else "layers replicated inside the stages"
        mesh = f"{cfg.stages} stages x {mesh}; {zero}; token pipeline of {job.slicing}"
    else:
        mesh = f"{mesh}; {cfg.zero}"
    moved = (
        f"; per device per step {job.cross_node_bytes:,.0f} B across nodes, "
        f"{job.intra_node_bytes:,.0f} B inside"
        if job.train_step is not None
        else ""
    )
    moved += f"; state {job.state_bytes:,} B per device"
    if cfg.lora is not None:
        trained = nnx.state(job.trainer.model(job.state), nnx.Param)
        lora = sum(x.size for x in jax.tree.leaves(trained))
        params = f"{params:,} frozen parameters and {lora:,} of LoRA (rank {cfg.lora})"
    else:
        params = f"{params:,} parameters"
    output.log(f"{model_name(cfg)}: {params}; mesh {mesh}{moved}")
    output.log(f"data: {job.corpus}")
    records, finished = [], False
    try:
        for rec in loop(job, stop):
            records.append(rec)
            output.record(rec)
        finished = True
    finally:
        output.close(records, finished)
    return records
