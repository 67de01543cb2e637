"""The configuration of the ZeRO++ techniques: one frozen, validated
dataclass, whose fields also define the command line's technique flags
(`zpp_jax.fields`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence

from zpp_jax.errors import UsageError, count
from zpp_jax.fields import option

_SUPPORTED_WEIGHT_BITS = (4, 8)
_SUPPORTED_GRADIENT_BITS = (4, 8)
_SUPPORTED_RESIDUAL_DTYPES = ("float32", "bfloat16")
_SUPPORTED_ROUNDINGS = ("stochastic", "nearest")
_SUPPORTED_SCALE_DTYPES = ("bfloat16", "float32")
_SUPPORTED_REMATS = ("dots", "none", "full")
_WIRE_DTYPES = ("bfloat16", "float32", "float16")
# One scale per block: above 2^24 elements a block is one tensor's worth.
_MAX_BLOCK = 1 << 24
BLOCK = count(1, _MAX_BLOCK, "elements per block")
TECHNIQUES = "ZeRO++ techniques (all on by default)"


def bits_or_none(text: str) -> int | None:
    """A command line's bits: a number, or ``none`` (any case) for None."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use 8, 4 or none") from None


@dataclasses.dataclass(frozen=True)
class ZeroPPConfig:
    """Which ZeRO++ techniques run, and how.

    Every technique switches on and off on its own; with all three off the
    engine is plain ZeRO-3 (fully sharded data parallel) and its gradients equal
    an unsharded reference to fp32 round-off.

    Attributes:
      quantize_weights: qwZ. All-gather weights as block-quantized integer codes
        plus one fp32 scale per block instead of full precision.
      weight_bits: 8 or 4 bits per weight code (4-bit codes travel two per byte).
      hpz: hierarchical partitioning. After the forward all-gather each device
        keeps a secondary shard (1/local of the gathered weight, in the wire
        format); the backward pass re-gathers only over the `local` axis, so no
        weight crosses a node boundary in the backward pass.
      quantize_gradients: qgZ. Reduce gradients with a quantized hierarchical
        all-to-all (inside the node, then across nodes on 1/local of the data)
        instead of a reduce-scatter.
      gradient_bits: 4 or 8 bits per gradient code.
      error_feedback: carry each device's quantization error of the gradient
        into the next step (only meaningful with `quantize_gradients`). Costs a
        residual of (1 + 1/local) x the parameter count per device, stored in
        `residual_dtype`.
      residual_dtype: "float32" or "bfloat16" storage for the error-feedback
        residual.
      block_size: elements per weight quantization block (one fp32 scale each).
        Must be even for 4-bit codes, so that two codes share a byte without
        straddling blocks.
      gradient_block_size: elements per gradient quantization block (None: as
        `block_size`). Gradients have heavier tails than weights, so they get
        smaller blocks by default (32: with bf16 scales, 2 bytes per 16 bytes
        of int4 codes, the bytes of 64-blocks with fp32 scales).
      gradient_scale_dtype: the dtype gradient scales travel in, "bfloat16"
        (scales rounded up to 8 significant bits, at most 0.8% coarser
        steps; 2 bytes a block) or "float32" (16 significant bits, 4 bytes).
      gradient_rounding: how gradient codes are rounded: "stochastic"
        (unbiased: a code is x/scale rounded up or down with the probability
        that makes its mean exact, drawn from a hash of the value, so runs stay
        bit-reproducible) or "nearest" (half to even: half the error per
        element, but small gradients in a block of large ones round to zero
        step after step). 4-bit codes have only 15 levels, and on small models
        nearest rounding costs several percent of loss over a short run.
        Weights are always rounded to nearest.
      frozen_bits: 8 or 4 bits per code of the frozen kernels a LoRA
        adapts (``zpp.shard(freeze=...)``; `zpp_jax.frozen.adapted_kernels`):
        each unit's are quantized once, stored as codes and scales (about a
        quarter or an eighth of fp32), gathered as codes (with hpZ: over the
        node, then inside it) in both passes, and never get a gradient.
        None: stored in their own dtype and gathered as weights are. Other
        frozen parameters always keep their own dtype.
      comm_dtype: dtype of the *unquantized* collectives (the plain all-gather
        and reduce-scatter), e.g. "bfloat16" for a ZeRO-3 baseline that moves
        bf16 weights and gradients. None moves the fp32 master values exactly.
      remat: what a unit keeps from its forward pass for its backward pass.
        Gathered weights are never kept: the backward pass gathers them again
        (with hpZ only inside the node), whatever the choice.
        "dots" (default): the outputs of the unit's matmuls are kept and its
        elementwise operations recomputed, so the backward pass runs no
        matmul of the forward pass again. "none": everything autodiff keeps
        (as plain `jax.jit` does), elementwise intermediates included, so
        nothing is recomputed, but every intermediate is written and read
        back (more memory, and more memory traffic than recomputing the
        cheap ones). "full": only the unit's input is kept and its
        whole forward pass is recomputed (one more forward pass, the least
        activation memory). A `jax.checkpoint` policy (e.g.
        ``jax.checkpoint_policies.save_only_these_names("attn")``): what the
        policy saves is kept, the rest recomputed. Changes memory and time,
        not the math.
      unroll_layer_loops: where units relay their collectives (a GPU mesh),
        unroll every layer loop (``nnx.scan``, ``jax.lax.scan``) whose body
        calls a sharded unit, and relay its units across iterations as an
        unrolled model's are (`zpp_jax.overlap.loops`): one layer's gradient
        reduction and the next layer's gather can then run behind the
        neighbouring layers' matrix multiplies, which no schedule of a loop
        body allows. The same arithmetic; the compiled program grows with
        the number of layers (compile time). Off: layer loops stay loops.
        No effect on a CPU mesh, whose collectives run in program order.
      persistence_threshold: parameters of fewer elements (per layer of a
        stack) are not sharded but kept whole on every device, as DeepSpeed's
        ``stage3_param_persistence_threshold`` keeps them: no gather, and
        their gradient is summed over the devices in fp32 by XLA's
        all-reduce. A unit whose parameters are all that small runs no
        collective of its own. For norms and biases, whose gathers are a few
        kilobytes each and cost a collective's latency for nothing. Costs
        their size on every device. 0 (default): every parameter sharded.
    """

    quantize_weights: bool = option(
        True, "gather weights unquantized", name="--no-qwz", negate=True, group=TECHNIQUES
    )
    weight_bits: int = option(
        8, "bits per weight code", type=int, choices=_SUPPORTED_WEIGHT_BITS, group=TECHNIQUES
    )
    hpz: bool = option(
        True, "no secondary partition", name="--no-hpz", negate=True, group=TECHNIQUES
    )
    quantize_gradients: bool = option(
        True, "plain reduce-scatter of gradients", name="--no-qgz", negate=True, group=TECHNIQUES
    )
    gradient_bits: int = option(
        4, "bits per gradient code", type=int, choices=_SUPPORTED_GRADIENT_BITS, group=TECHNIQUES
    )
    error_feedback: bool = option(False, "carry gradient rounding errors", group=TECHNIQUES)
    residual_dtype: str = "float32"
    block_size: int = option(256, "elements per weight block", type=BLOCK, group=TECHNIQUES)
    gradient_block_size: int | None = option(
        32, "elements per gradient block", type=BLOCK, group=TECHNIQUES
    )
    gradient_rounding: str = option(
        "stochastic",
        "rounding of gradient codes (stochastic: unbiased)",
        choices=_SUPPORTED_ROUNDINGS,
        group=TECHNIQUES,
    )
    gradient_scale_dtype: str = option(
        "bfloat16",
        "dtype gradient scales travel in",
        choices=_SUPPORTED_SCALE_DTYPES,
        group=TECHNIQUES,
    )
    frozen_bits: int | None = option(
        8,
        "bits per code of the frozen kernels a LoRA adapts (zpp.shard(freeze=)): they are "
        "stored and gathered as codes; none: kept and gathered in their own dtype",
        type=bits_or_none,
        choices=(8, 4, None),
        group=TECHNIQUES,
    )
    comm_dtype: str | None = option(
        None,
        "wire dtype of the unquantized collectives",
        choices=_WIRE_DTYPES,
        group=TECHNIQUES,
    )
    remat: str | Callable[..., bool] = option(
        "dots",
        "what a unit keeps for its backward pass: its matmul outputs (dots), every activation "
        "(none) or only its input (full: one more forward pass); never its gathered weights",
        choices=_SUPPORTED_REMATS,
    )
    unroll_layer_loops: bool = True
    persistence_threshold: int = 0

    def __post_init__(self) -> None:
        for name in (
            "quantize_weights",
            "hpz",
            "quantize_gradients",
            "error_feedback",
            "unroll_layer_loops",
        ):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.weight_bits not in _SUPPORTED_WEIGHT_BITS:
            raise UsageError(
                f"weight_bits={self.weight_bits!r} is not supported; use one of "
                f"{_SUPPORTED_WEIGHT_BITS}"
            )
        if self.frozen_bits not in (*_SUPPORTED_WEIGHT_BITS, None):
            raise UsageError(
                f"frozen_bits={self.frozen_bits!r} is not supported; use one of "
                f"{_SUPPORTED_WEIGHT_BITS}, or None to keep frozen weights in their dtype"
            )
        if self.gradient_bits not in _SUPPORTED_GRADIENT_BITS:
            raise UsageError(
                f"gradient_bits={self.gradient_bits!r} is not supported; use one of "
                f"{_SUPPORTED_GRADIENT_BITS}"
            )
        _check_block("block_size", self.block_size, self.quantize_weights and self.weight_bits == 4)
        if self.gradient_block_size is not None:
            _check_block("gradient_block_size", self.gradient_block_size, False)
        _check_block(
            "gradient_block_size" if self.gradient_block_size is not None else "block_size",
            self.grad_block,
            self.quantize_gradients and self.gradient_bits == 4,
        )
        if self.error_feedback and not self.quantize_gradients:
            raise UsageError(
                "error_feedback=True needs quantize_gradients=True: there is no "
                "quantization error to feed back otherwise"
            )
        if self.gradient_rounding not in _SUPPORTED_ROUNDINGS:
            raise UsageError(
                f"gradient_rounding={self.gradient_rounding!r} is not supported; use one of "
                f"{_SUPPORTED_ROUNDINGS}"
            )
        if self.gradient_scale_dtype not in _SUPPORTED_SCALE_DTYPES:
            raise UsageError(
                f"gradient_scale_dtype={self.gradient_scale_dtype!r} is not supported; use "
                f"one of {_SUPPORTED_SCALE_DTYPES}"
            )
        if self.residual_dtype not in _SUPPORTED_RESIDUAL_DTYPES:
            raise UsageError(
                f"residual_dtype={self.residual_dtype!r} is not supported; use one of "
                f"{_SUPPORTED_RESIDUAL_DTYPES}"
            )
        if (
            not isinstance(self.persistence_threshold, int)
            or isinstance(self.persistence_threshold, bool)
            or self.persistence_threshold < 0
        ):
            raise UsageError(
                "persistence_threshold must be an int >= 0 (elements; 0 shards every "
                f"parameter), got {self.persistence_threshold!r}"
            )
        if not callable(self.remat) and self.remat not in _SUPPORTED_REMATS:
            raise UsageError(
                f"remat={self.remat!r} is not supported; use one of {_SUPPORTED_REMATS} or a "
                "jax.checkpoint policy (e.g. jax.checkpoint_policies.save_only_these_names)"
            )
        if self.comm_dtype not in (None, *_WIRE_DTYPES):
            raise UsageError(
                f"comm_dtype={self.comm_dtype!r} is not supported; use None, 'float32', "
                "'bfloat16' or 'float16'"
            )

    @property
    def alignment(self) -> int:
        """The flat-layout alignment that keeps every quantization block inside
        one tensor: the lcm of the active block sizes (1 if nothing is quantized)."""
        sizes = [1]
        if self.quantize_weights:
            sizes.append(self.block_size)
        if self.quantize_gradients:
            sizes.append(self.grad_block)
        return math.lcm(*sizes)

    @property
    def grad_block(self) -> int:
        """Block size used for gradients."""
        return self.block_size if self.gradient_block_size is None else self.gradient_block_size

    @classmethod
    def zero3(cls, **overrides) -> ZeroPPConfig:
        """The ZeRO-3 baseline: every ZeRO++ technique off, weights and
        gradients on a bf16 wire (``comm_dtype="bfloat16"``), as bf16 training
        with DeepSpeed ZeRO-3 or FSDP moves them. The one definition of the
        baseline that `zpp train`, `zpp demo`, `zpp comm` and the benchmarks
        compare with.

        ``zero3(comm_dtype=None)`` moves the fp32 master values exactly: its
        gradients equal an unsharded model's to fp32 round-off.
        """
        base = dict(
            quantize_weights=False, hpz=False, quantize_gradients=False, comm_dtype="bfloat16"
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def check(cls, config, name: str = "config") -> ZeroPPConfig:
        """`config`, or the defaults for None; raises UsageError for anything
        that is not a ZeroPPConfig (a dict of its fields, say)."""
        if config is None:
            return cls()
        if not isinstance(config, cls):
            raise UsageError(
                f"{name} must be a zpp.ZeroPPConfig (or None for the defaults), got "
                f"{type(config).__name__}; e.g. zpp.ZeroPPConfig(**fields)"
            )
        return config

    def replace(self, **changes) -> ZeroPPConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_file(self, path, *, about: dict | None = None, overwrite: bool = False) -> None:
        """Write this configuration as JSON (``{"ZeroPPConfig": fields,
        "about": about}``), which `from_file` and ``zpp train --config``
        read. `about` is free-form provenance (what `zpp tune` measured).
        Refuses an existing file unless `overwrite`, and a callable `remat`
        (a policy function has no file form)."""
        import json
        import pathlib

        if callable(self.remat):
            raise UsageError(
                "a ZeroPPConfig with a remat function cannot be written to a file; use one of "
                f"{_SUPPORTED_REMATS}"
            )
        target = pathlib.Path(path)
        if target.exists() and not overwrite:
            raise UsageError(f"{target} exists: pass overwrite=True (--overwrite) to replace it")
        body = {"ZeroPPConfig": dataclasses.asdict(self), "about": about or {}}
        target.write_text(json.dumps(body, indent=1) + "\n")

    @classmethod
    def from_file(cls, path) -> ZeroPPConfig:
        """The configuration `to_file` (or `zpp tune`) wrote, validated as
        the constructor validates; a field it does not know is refused by
        name."""
        import json
        import pathlib

        try:
            body = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read a ZeroPPConfig from {path}: {e}") from None
        fields = body.get("ZeroPPConfig") if isinstance(body, dict) else None
        if not isinstance(fields, dict):
            raise UsageError(
                f'{path} holds no {{"ZeroPPConfig": {{...}}}} object; write one with '
                "ZeroPPConfig.to_file or zpp tune"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UsageError(
                f"{path}: unknown ZeroPPConfig fields {unknown}; known: {sorted(known)}"
            )
        return cls(**fields)


def _check_block(name: str, value, int4: bool) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{name} must be a positive int, got {value!r}")
    if value > _MAX_BLOCK:
        raise UsageError(f"{name} must be at most {_MAX_BLOCK:,} elements, got {value:,}")
    if int4 and value % 2:
        raise UsageError(
            f"{name}={value} is odd, but 4-bit codes are packed two per byte within a "
            f"block; use an even {name}"
        )


def check_block_sizes(config: ZeroPPConfig, sizes: Sequence[int]) -> None:
    """Raise UsageError when a quantization block is larger than the
    largest of the parameters (`sizes`, in elements): every tensor would
    be padded up to one block, for no accuracy."""
    largest = max(sizes, default=0)
    for name, on, value in (
        ("block_size", config.quantize_weights, config.block_size),
        ("gradient_block_size", config.quantize_gradients, config.grad_block),
    ):
        if on and value > largest:
            raise UsageError(
                f"{name}={value:,} is larger than the model's largest parameter ({largest:,} "
                f"elements): every tensor would be padded up to one block; use at most {largest:,}"
            )
