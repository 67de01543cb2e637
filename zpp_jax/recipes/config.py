"""One training run's settings: `RunConfig`, whose fields are also the
flags of ``zpp train`` (`zpp_jax.fields`): each with its default, its help
and its range, written once.

Importing this module costs no JAX.
"""

from __future__ import annotations

import dataclasses
import pathlib

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import Number, UsageError, count, is_stream, positive
from zpp_jax.fields import check_flags, flag_name, option

ARCHS = ("gpt", "llama")
DTYPES = ("bfloat16", "float32", "float16")
PIPELINE = "token pipeline (TeraPipe)"
INIT_SEQ = 2048  # the longest default sequence of a run from a checkpoint
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # zpp_jax.lora.DEFAULT_TARGETS


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run. The model is `arch` at size `model` (a preset)."""

    zero: ZeroPPConfig = ZeroPPConfig(comm_dtype="bfloat16")
    init: str | None = option(
        None,
        "fine-tune the Hugging Face checkpoint in this directory (config.json, safetensors "
        "weights, tokenizer.json; a Llama, Mistral or Qwen2): its architecture, weights and "
        "tokenizer stand for --arch, --model and --tokenizer",
    )
    lora: int | None = option(
        None,
        "train LoRA adapters of this rank over the frozen base (stored as --frozen-bits codes) "
        "instead of every weight",
        type=count(why="dimensions of each adapter"),
    )
    lora_targets: str = option(
        ",".join(LORA_TARGETS), "the linear layers --lora adapts, by attribute name"
    )
    lora_alpha: float | None = option(
        None,
        "LoRA's alpha: the adapters' update is scaled by alpha / rank (default: the rank, an "
        "unscaled update; PEFT's default is 8 whatever the rank)",
        type=Number(float, 0, above=True, why="a scale"),
    )
    arch: str = option("gpt", "the model family", choices=ARCHS)
    model: str = option("tiny", "size preset: tiny, small (both), 125m (gpt)")
    seq_len: int | None = option(
        None,
        "sequence length (default: the preset's; with --init, the checkpoint's, at most "
        f"{INIT_SEQ})",
        type=count(why="tokens; leave it out for the preset's length"),
        name="--seq",
    )
    nodes: int = option(2, "nodes; under zpp launch, the job's process count", type=count())
    local: int = option(
        4, "devices per node; under zpp launch, each process's device count", type=count()
    )
    tp: int = option(
        1,
        "tensor-parallel degree: each layer's heads, MLP and vocabulary split over this many "
        "of a node's --local devices, ZeRO++ over the rest (1: none)",
        type=count(why="devices per tensor-parallel group"),
    )
    batch: int = option(16, "global batch (sequences)", type=count(why="sequences per step"))
    grad_accum: int = option(
        1, "micro-batches per step", type=count(why="micro-batches, at most --batch")
    )
    steps: int = option(
        200, "optimizer steps", type=count(why="the optimizer counts steps in int32")
    )
    lr: float = option(3e-3, "peak learning rate", type=positive("a learning rate"))
    warmup: int = option(20, "steps of linear warmup", type=count(0, why="steps"))
    clip: float = option(1.0, "global gradient-norm clip", type=positive("a gradient norm"))
    weight_decay: float = option(
        0.1, "AdamW's weight decay", type=Number(float, 0, why="a decay rate")
    )
    compute_dtype: str = option("bfloat16", "dtype the model computes in", choices=DTYPES)
    seed: int = option(
        0, "seed of the parameters and the data order", type=count(0, 2**32 - 1, "32 bits")
    )
    data: str | None = option(
        None,
        "train on this instead of the Python standard library's source: a text file, a "
        "directory or glob of text files, token files (.bin uint16, .npy uint16/uint32), or "
        'fine-tuning examples (.jsonl: {"prompt", "completion"}, the loss on the completion '
        'only; {"messages"}, conversations, the loss on the assistant turns; or {"text"})',
    )
    val_data: str | None = option(None, "validation data (default: the last 5% of --data)")
    tokenizer: str = option(
        "byte",
        "byte, bpe:N (a byte-level BPE of N ids trained on the training text), or a "
        "tokenizer.json; saved with the checkpoints and reused on --resume",
    )
    accept_binary: bool = option(
        False,
        "train on --data that is not UTF-8 text (a binary file, random bytes) without the "
        "warning (--tokenizer byte) or the error (BPE, a tokenizer.json)",
    )
    vocab_size: int | None = None  # the model's; `build` sets the tokenizer's
    eval_every: int = option(50, "steps between evaluations", type=count(0, why="steps; 0: never"))
    eval_batches: int = option(4, "batches per evaluation", type=count())
    metrics: str | None = option(None, "write JSON lines here")
    plot: str | None = option(None, "loss plot PNG (default: beside --metrics)")
    ckpt_dir: str | None = option(None, "directory of the run's checkpoints")
    ckpt_every: int = option(
        0, "steps between checkpoints", type=count(0, why="steps; 0: only the last")
    )
    resume: bool = option(
        False,
        "continue the run in --ckpt-dir from its newest intact checkpoint (the same "
        "settings are required; a missing or empty directory starts a new run)",
    )
    overwrite: bool = option(
        False,
        "delete the checkpoints in --ckpt-dir and the --metrics file of an earlier run and "
        "start a new one (without it, a run never reuses them)",
    )
    progress: bool = option(True, "no progress bar or log lines", name="--quiet", negate=True)
    # Token pipeline (TeraPipe): stages > 1 trains through `PipelineTrainer`.
    stages: int = option(
        1,
        "pipeline stages, each of --nodes x --local devices (1: no pipeline); under zpp "
        "launch, stages x nodes = processes",
        type=count(),
        group=PIPELINE,
    )
    slices: str = option(
        "auto",
        "token slices of a sequence: auto (planned, see --cost), a count of equal slices, "
        "or the lengths l1,l2,...",
        group=PIPELINE,
    )
    stage_zero: bool = option(
        True,
        "replicate each stage's layers over its devices instead of sharding them with the "
        "ZeRO flags",
        name="--no-stage-zero",
        negate=True,
        group=PIPELINE,
    )
    cost: str | None = option(
        None,
        "cost model JSON (zpp profile) for --slices auto (default: the analytic model)",
        group=PIPELINE,
    )

    def __post_init__(self) -> None:
        check_flags(self)
        if self.init is not None:
            fields = {f.name: f for f in dataclasses.fields(self)}
            given = [
                flag_name(fields[name])
                for name in INIT_GIVES
                if getattr(self, name) != fields[name].default
            ]
            if given:
                raise UsageError(init_conflict(self.init, given))
        if self.grad_accum > self.batch:
            raise UsageError(
                f"--grad-accum {self.grad_accum} splits --batch {self.batch} into more "
                "micro-batches than it has sequences; use at most --batch"
            )
        if (self.ckpt_every or self.resume) and not self.ckpt_dir:
            raise UsageError("checkpointing and --resume need --ckpt-dir")
        if self.lora is None and self.lora_targets != ",".join(LORA_TARGETS):
            raise UsageError("--lora-targets names the layers --lora adapts: pass --lora RANK")
        if self.lora is not None and not any(t.strip() for t in self.lora_targets.split(",")):
            raise UsageError(
                f"--lora-targets {self.lora_targets!r} names no layer: give the linear layers "
                f"to adapt, such as q,v (default {','.join(LORA_TARGETS)})"
            )
        if self.lora is None and self.lora_alpha is not None:
            raise UsageError("--lora-alpha scales the adapters --lora trains: pass --lora RANK")
        if self.lora is None and self.zero.frozen_bits != ZeroPPConfig().frozen_bits:
            raise UsageError(
                "--frozen-bits sets how the frozen kernels --lora adapts are stored; without "
                "--lora every weight trains: pass --lora RANK, or drop --frozen-bits"
            )
        if self.lora is not None and self.stages > 1:
            raise UsageError(
                "--lora trains through zpp.shard; the token pipeline (--stages) "
                "does not take frozen weights: drop one"
            )
        if self.tp > 1:
            self._check_tensor_parallel()
        if self.resume and self.overwrite:
            raise UsageError("--resume continues a run and --overwrite deletes it: pass one")
        if self.stages > 1:
            if self.grad_accum != 1:
                raise UsageError(
                    "--grad-accum splits the batch into micro-batches, which the token "
                    "pipeline does not take; drop --grad-accum or --stages"
                )
            parse_slices(self.slices)
        elif self.slices != "auto" or self.cost is not None or not self.stage_zero:
            raise UsageError(
                "--slices, --cost and --no-stage-zero set up the token pipeline: pass "
                "--stages K (K > 1) with them"
            )

    def _check_tensor_parallel(self) -> None:
        """Raise UsageError unless --tp divides --local and nothing it does
        not combine with yet is on."""
        check_degree(self.tp, self.local)
        other = (
            "--lora"
            if self.lora is not None
            else "--stages"
            if self.stages > 1
            else "--error-feedback"
            if self.zero.error_feedback
            else None
        )
        if other is not None:
            raise UsageError(f"--tp does not yet combine with {other}: drop one")

    @property
    def data_local(self) -> int:
        """A node's data-parallel devices: --local / --tp."""
        return self.local // self.tp

    @property
    def tokenizer_spec(self) -> str:
        """The tokenizer the run uses: the checkpoint's with `init`."""
        if self.init is not None:
            return str(pathlib.Path(self.init) / "tokenizer.json")
        return self.tokenizer


# The settings a checkpoint (`RunConfig.init`) gives, so that none may be set.
INIT_GIVES = ("arch", "model", "tokenizer")


def check_degree(tp: int, local: int) -> None:
    """Raise UsageError unless a tensor-parallel degree `tp` divides a
    node's `local` devices (the `model` axis lies inside a node)."""
    if local % tp:
        raise UsageError(
            f"--tp {tp} must divide --local {local}: a node's devices are "
            "--local / --tp data-parallel groups of --tp"
        )


def init_conflict(init: str, flags: list[str]) -> str:
    """The refusal of `flags` that contradict ``--init``."""
    it = "them" if len(flags) > 1 else "it"
    return (
        f"--init {init} takes the architecture, size and tokenizer from the checkpoint, "
        f"so {', '.join(flags)} would contradict it; drop {it}"
    )


def parse_slices(text: str) -> str | int | tuple[int, ...]:
    """`--slices`: "auto", a slice count "N", or lengths "l1,l2,..."."""
    if text == "auto":
        return text
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        raise UsageError(
            f"--slices {text!r}: use auto, a number of equal slices (8), or the slice "
            "lengths (16,16,32), all positive"
        )
    return values[0] if len(values) == 1 and "," not in text else values


def default_plot(metrics: str) -> str | None:
    """The loss plot beside a metrics file, named after it (``run/m.jsonl``:
    ``run/m.png``); none for a stream (standard output, a pipe)."""
    path = pathlib.Path(metrics)
    if is_stream(metrics) or not path.name:  # no name: `check_paths` says what is wrong
        return None
    return str(
        path.with_name(path.name + ".png") if path.suffix == ".png" else path.with_suffix(".png")
    )
