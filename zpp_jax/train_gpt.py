"""The main job: train the reference GPT with ZeRO++ on byte-level text.

`zpp train` and `examples/train_gpt.py` call `run`. Everything a run needs is
in `RunConfig`; a run is reproducible bit for bit from its seed, and resumable
from its checkpoints at the exact batch where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zpp_jax.checkpoint import Checkpointer
from zpp_jax.config import ZeroPPConfig
from zpp_jax.data import ByteDataset, host_to_global, load_text, stdlib_corpus
from zpp_jax.errors import UsageError
from zpp_jax.mesh import make_mesh
from zpp_jax.models.gpt import GPT, GPTConfig
from zpp_jax.report import summarize
from zpp_jax.train import Trainer, nnx_parts


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run. Sizes of the model come from `model` (a preset)."""

    zero: ZeroPPConfig = ZeroPPConfig(comm_dtype="bfloat16")
    model: str = "tiny"
    seq_len: int | None = None
    nodes: int = 2
    local: int = 4
    batch: int = 16
    grad_accum: int = 1
    steps: int = 200
    lr: float = 3e-3
    warmup: int = 20
    clip: float = 1.0
    weight_decay: float = 0.1
    compute_dtype: str = "bfloat16"
    seed: int = 0
    data: str | None = None
    eval_every: int = 50
    eval_batches: int = 4
    metrics: str | None = None
    plot: str | None = None
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("nodes", "local", "batch", "grad_accum", "steps", "eval_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise UsageError(f"{name} must be a positive int, got {v!r}")
        if self.ckpt_every < 0 or self.eval_every < 0:
            raise UsageError("ckpt_every and eval_every must be >= 0 (0: never)")
        if (self.ckpt_every or self.resume) and not self.ckpt_dir:
            raise UsageError("checkpointing and --resume need --ckpt-dir")


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup, 1), max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay),
    )


def model_config(cfg: RunConfig) -> GPTConfig:
    model_cfg = GPTConfig.preset(cfg.model, dtype=cfg.compute_dtype)
    if cfg.seq_len:
        model_cfg = dataclasses.replace(model_cfg, seq_len=cfg.seq_len)
    return model_cfg


def make_trainer(cfg: RunConfig) -> Trainer:
    """The GPT, optimizer, mesh and `Trainer` of a run (parameters from `cfg.seed`)."""
    from flax import nnx

    model = GPT(model_config(cfg), nnx.Rngs(cfg.seed))
    return Trainer(
        nnx_parts(model),
        make_optimizer(cfg),
        make_mesh(cfg.nodes, cfg.local),
        cfg.zero,
        compute_dtype=jnp.dtype(cfg.compute_dtype),
        grad_accum=cfg.grad_accum,
    )


def run(cfg: RunConfig) -> list[dict]:
    """Train; returns the metrics records (also written to `cfg.metrics`)."""
    model_cfg = model_config(cfg)
    tokens = load_text(cfg.data) if cfg.data else stdlib_corpus()
    data = ByteDataset(tokens, model_cfg.seq_len)
    trainer = make_trainer(cfg)
    trainer.check_batch_size(cfg.batch)
    ckpt = Checkpointer(cfg.ckpt_dir) if cfg.ckpt_dir else None
    position = 0
    if cfg.resume and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(trainer)
        position = meta["data_position"]
        _log(cfg, f"resumed from step {int(state.step)} at batch {position} in {cfg.ckpt_dir}")
    else:
        state = trainer.init()

    sharding = trainer.batch_sharding()

    def batch(split, index):
        return host_to_global(data.batch(split, index, cfg.batch, cfg.seed), sharding)

    step_fn = trainer.step.lower(state, batch("train", 0)).compile()
    moved = summarize(step_fn.as_text(), cfg.local)
    eval_fn = trainer.evaluate.lower(state, batch("val", 0)).compile()
    _log(
        cfg,
        f"GPT {cfg.model}: {model_cfg.num_params():,} parameters; mesh {cfg.nodes} x "
        f"{cfg.local}; {cfg.zero}; per device per step {moved.cross_node_bytes:,.0f} B "
        f"across nodes, {moved.intra_node_bytes:,.0f} B inside",
    )

    def evaluate(state):
        return float(
            np.mean([float(eval_fn(state, batch("val", i))) for i in range(cfg.eval_batches)])
        )

    for path in (cfg.metrics, cfg.plot):
        if path:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    records = []
    lead = jax.process_index() == 0  # one process writes files and progress
    out = (
        open(cfg.metrics, "a" if cfg.resume else "w")  # noqa: SIM115
        if cfg.metrics and lead
        else None
    )
    bar = _progress(cfg, position)
    tokens_per_step = cfg.batch * model_cfg.seq_len
    try:
        while position < cfg.steps:
            start = time.perf_counter()
            state, metrics = step_fn(state, batch("train", position))
            loss = float(metrics["loss"])
            elapsed = time.perf_counter() - start
            position += 1
            rec = {
                "step": position,
                "loss": loss,
                "grad_norm": float(metrics["grad_norm"]),
                "skipped": int(metrics["skipped"]),
                "tokens_per_s": tokens_per_step / elapsed,
                "cross_node_bytes": moved.cross_node_bytes,
            }
            if (cfg.eval_every and position % cfg.eval_every == 0) or position == cfg.steps:
                rec["val_loss"] = evaluate(state)
            if ckpt and (
                (cfg.ckpt_every and position % cfg.ckpt_every == 0) or position == cfg.steps
            ):
                ckpt.save(trainer, state, position)
            records.append(rec)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if bar is not None:
                bar.set_postfix(
                    loss=f"{loss:.4f}",
                    tok_s=f"{rec['tokens_per_s']:,.0f}",
                    xnode_MB=f"{moved.cross_node_bytes / 1e6:.2f}",
                )
                bar.update(1)
    finally:
        if out:
            out.close()
        if bar is not None:
            bar.close()
    if records:
        last = records[-1]
        _log(
            cfg,
            f"step {last['step']}: loss {last['loss']:.4f}, "
            f"val_loss {last.get('val_loss', float('nan')):.4f}",
        )
    if cfg.plot and lead:
        plot_losses(cfg.metrics, cfg.plot, records)
    return records


def plot_losses(metrics_file: str | None, path: str, records: list[dict]) -> None:
    """PNG of train and validation loss (all records of `metrics_file` if given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if metrics_file and pathlib.Path(metrics_file).exists():
        with open(metrics_file) as f:
            records = [json.loads(line) for line in f]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train", lw=1)
    val = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _progress(cfg: RunConfig, position: int):
    if not cfg.progress or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=position, desc="train", dynamic_ncols=True)


def _log(cfg: RunConfig, message: str) -> None:
    if cfg.progress and jax.process_index() == 0:
        from tqdm import tqdm

        tqdm.write(message)
