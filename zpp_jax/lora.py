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

import jax.numpy as jnp
from flax import nnx

from zpp_jax.errors import UsageError

__all__ = ["DEFAULT_TARGETS", "FROZEN", "add_lora", "merge_lora"]

# The linear layers of `zpp_jax.models.Llama` (attention and MLP).
DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
FROZEN = nnx.Not(nnx.LoRAParam)


def add_lora(
    model: nnx.Module,
    rank: int,
    targets: Sequence[str] = DEFAULT_TARGETS,
    *,
    seed: int = 0,
) -> nnx.Module:
    """`model` with each `nnx.Linear` attribute named in `targets` wrapped
    in an `nnx.LoRA` of `rank` (in place; returned). The adapters' `a` is
    drawn from `seed`, `b` is zero.

    Raises:
      UsageError: a rank that is not a positive int, or no linear layer of
        those names.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise UsageError(f"LoRA rank {rank!r}: use a positive number of dimensions, such as 8")
    rngs = nnx.Rngs(seed)
    wrapped = 0
    for _, module in list(nnx.iter_modules(model)):
        for name in targets:
            base = getattr(module, name, None)
            if isinstance(base, nnx.Linear):
                lora = nnx.LoRA(
                    base.in_features,
                    rank,
                    base.out_features,
                    base_module=base,
                    dtype=base.dtype,
                    rngs=rngs,
                )
                setattr(module, name, lora)
                wrapped += 1
    if not wrapped:
        raise UsageError(
            f"no linear layer named {', '.join(targets)} in {type(model).__name__}: name the "
            "model's nnx.Linear attributes to adapt with --lora-targets"
        )
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """`model` (plain, not sharded) with each `nnx.LoRA` around an
    `nnx.Linear` replaced by that linear layer, its kernel plus ``a @ b``
    (in fp32, cast back to the kernel's dtype); in place, returned."""
    for _, module in list(nnx.iter_modules(model)):
        for name, value in list(vars(module).items()):
            if isinstance(value, nnx.LoRA) and isinstance(value.base_module, nnx.Linear):
                base = value.base_module
                delta = value.lora_a[...].astype(jnp.float32) @ value.lora_b[...].astype(
                    jnp.float32
                )
                kernel = base.kernel[...]
                base.kernel = nnx.Param((kernel.astype(jnp.float32) + delta).astype(kernel.dtype))
                setattr(module, name, base)
    return model
