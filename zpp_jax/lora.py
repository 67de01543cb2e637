"""LoRA: low-rank adapters on a model's linear layers, trained over a
frozen base.

`add_lora(model, rank)` wraps each `nnx.Linear` named in `targets` in an
`nnx.LoRA` (``y = base(x) + x @ a @ b``, `b` starting at zero, so the
model computes what it did). `FROZEN` is the filter of everything but the
adapters: ``zpp.shard(model, mesh, config, freeze=FROZEN)`` stores the adapted
kernels as ``config.frozen_bits`` codes (the rest of the base in its own
dtype, as QLoRA does) and trains the adapters alone, and
``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` updates them alone on any
model with `nnx.LoRA` layers. `merge_lora` folds the adapters into their
base kernels (for export).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from zpp_jax.errors import UsageError

__all__ = ["DEFAULT_TARGETS", "FROZEN", "ScaledLoRA", "add_lora", "merge_lora"]

# The linear layers of `zpp_jax.models.Llama` (attention and MLP).
DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
FROZEN = nnx.Not(nnx.LoRAParam)


class ScaledLoRA(nnx.LoRA):
    """`nnx.LoRA` whose update is scaled: ``base(x) + scale * (x @ a @ b)``,
    with ``scale = alpha / rank`` as the LoRA paper writes it."""

    def __init__(self, *args, scale: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = float(scale)

    def __call__(self, x: jax.Array, **kwargs) -> jax.Array:
        x, lora_a, lora_b = self.promote_dtype(
            (x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype
        )
        update = x @ lora_a @ lora_b
        if self.scale != 1.0:
            update = update * jnp.asarray(self.scale, update.dtype)
        return self.base_module(x, **kwargs) + update


def add_lora(
    model: nnx.Module,
    rank: int,
    targets: Sequence[str] = DEFAULT_TARGETS,
    *,
    seed: int = 0,
    alpha: float | None = None,
) -> nnx.Module:
    """`model` with each `nnx.Linear` attribute named in `targets` wrapped
    in a `ScaledLoRA` of `rank` (in place; returned): its update scaled by
    ``alpha / rank`` (default alpha: the rank, so unscaled). The adapters'
    `a` is drawn from `seed`, `b` is zero.

    Raises:
      UsageError: a model with adapters already, a rank that is not a
        positive int or is more than a layer's features, targets that are
        not a sequence of names, or a target that names no linear layer
        (the error lists the names there are).
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise UsageError(f"LoRA rank {rank!r}: use a positive number of dimensions, such as 8")
    if any(isinstance(m, nnx.LoRA) for _, m in nnx.iter_modules(model)):
        raise UsageError(
            f"{type(model).__name__} has LoRA adapters already (add_lora ran on it): train "
            "them as they are, or add new ones to merge_lora(model)"
        )
    if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
        raise UsageError(
            f"LoRA targets {targets!r}: pass a sequence of attribute names, such as "
            "('q', 'v') or ['gate']"
        )
    if not targets:
        raise UsageError(
            f"LoRA targets {targets!r} name no layer: name the nnx.Linear attributes to adapt "
            f"(it has {_linear_names(model)})"
        )
    layers = _linear_layers(model, targets)
    missing = [t for t in targets if t not in {name for _, name, _ in layers}]
    if missing:
        raise UsageError(
            f"no linear layer named {', '.join(missing)} in {type(model).__name__}: name the "
            f"model's nnx.Linear attributes to adapt with --lora-targets (it has "
            f"{_linear_names(model)})"
        )
    narrowest = min(min(b.in_features, b.out_features) for _, _, b in layers)
    if rank > narrowest:
        raise UsageError(
            f"LoRA rank {rank} is more than the {narrowest} features of the narrowest layer it "
            f"adapts (a rank of {narrowest} is already a full-rank update): use at most {narrowest}"
        )
    if alpha is not None and not (isinstance(alpha, int | float) and 0 < alpha < float("inf")):
        raise UsageError(f"LoRA alpha {alpha!r}: use a positive number, such as the rank")
    scale = 1.0 if alpha is None else alpha / rank
    rngs = nnx.Rngs(seed)
    for module, name, base in layers:
        lora = ScaledLoRA(
            base.in_features,
            rank,
            base.out_features,
            base_module=base,
            dtype=base.dtype,
            rngs=rngs,
            scale=scale,
        )
        setattr(module, name, lora)
    return model


def _linear_names(model: nnx.Module) -> str:
    """The attribute names of `model`'s `nnx.Linear` layers, for a message."""
    names = sorted({name for _, name, _ in _linear_layers(model, None)})
    return ", ".join(names) if names else "none"


def _linear_layers(model: nnx.Module, targets: Sequence[str] | None) -> list:
    """(module, attribute name, layer) of each `nnx.Linear` attribute of
    `model`'s modules named in `targets` (None: every one)."""
    found = []
    for _, module in list(nnx.iter_modules(model)):
        names = list(vars(module)) if targets is None else targets
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, nnx.Linear):
                found.append((module, name, value))
    return found


def merge_lora(model: nnx.Module) -> nnx.Module:
    """`model` (plain, not sharded) with each `nnx.LoRA` around an
    `nnx.Linear` replaced by that linear layer, its kernel plus ``scale *
    a @ b`` (`ScaledLoRA`'s scale, else 1; in fp32, cast back to the
    kernel's dtype); in place, returned."""
    for _, module in list(nnx.iter_modules(model)):
        for name, value in list(vars(module).items()):
            if isinstance(value, nnx.LoRA) and isinstance(value.base_module, nnx.Linear):
                base = value.base_module
                a, b = value.lora_a[...].astype(jnp.float32), value.lora_b[...].astype(jnp.float32)
                delta = getattr(value, "scale", 1.0) * (a @ b)
                kernel = base.kernel[...]
                base.kernel = nnx.Param((kernel.astype(jnp.float32) + delta).astype(kernel.dtype))
                setattr(module, name, base)
    return model
