"""The recipe's optimizer: AdamW with linear warmup and cosine decay, whose
hyperparameters are data in its state, not constants in the program.

A run's compiled step is then the same program whatever its learning rate,
warmup, weight decay or step count: runs that differ only in those (a
sweep, a resumed run given more steps, `zpp tune`'s settings) compile the
step once and load it from the compilation cache after.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from zpp_jax.recipes.config import RunConfig

# The cosine decays to this fraction of the peak learning rate.
END_FRACTION = 0.1


def warmup_cosine(
    count: jax.Array, peak_lr: jax.Array, warmup_steps: jax.Array, decay_steps: jax.Array
) -> jax.Array:
    """`optax.warmup_cosine_decay_schedule(0, peak_lr, warmup_steps,
    decay_steps, END_FRACTION * peak_lr)` at `count`, with every argument an
    array (optax's checks its step counts in Python). The same formulas, in
    float32: equal to optax's to float32 round-off. Needs
    ``0 < warmup_steps < decay_steps``."""
    f32 = jnp.float32
    count, warmup, decay = (jnp.asarray(x).astype(f32) for x in (count, warmup_steps, decay_steps))
    peak = jnp.asarray(peak_lr).astype(f32)
    frac = 1 - jnp.clip(count, 0, warmup) / warmup
    warm = (0 - peak) * frac + peak
    cosine_steps = decay - warmup
    t = jnp.minimum(count - warmup, cosine_steps)
    cosine = 0.5 * (1 + jnp.cos(jnp.pi * t / cosine_steps))
    decayed = peak * ((1 - END_FRACTION) * cosine + END_FRACTION)
    return jnp.where(count < warmup, warm, decayed)


def schedule_hyperparams(cfg: RunConfig) -> dict[str, float | int]:
    """The values `make_optimizer` keeps in its state for `cfg`: the warmup
    at least 1 step, and the decay at least 1 step past it."""
    return {
        "peak_lr": cfg.lr,
        "warmup_steps": max(cfg.warmup, 1),
        "decay_steps": max(cfg.steps, cfg.warmup + 1),
        "weight_decay": cfg.weight_decay,
    }


def _adamw_warmup_cosine(peak_lr, warmup_steps, decay_steps, weight_decay):
    def schedule(count):
        return warmup_cosine(count, peak_lr, warmup_steps, decay_steps)

    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay)


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """AdamW (b1 0.9, b2 0.95) with `warmup_cosine`'s learning rate (the
    `Trainer` clips the gradients to norm `cfg.clip` before). Its state
    holds `schedule_hyperparams(cfg)` as four scalars
    (`optax.inject_hyperparams`); AdamW's own state is two moments the size
    of the parameters, as ever."""
    return optax.inject_hyperparams(_adamw_warmup_cosine)(**schedule_hyperparams(cfg))


def with_schedule_of(state: Any, cfg: RunConfig) -> Any:
    """`state` (a `Trainer`'s, restored from a checkpoint) with the
    hyperparameters of `cfg` in place of those it was saved with: a resumed
    run follows its own `--steps` (the others are part of the run's
    identity, so they are equal). Each scalar keeps its dtype and
    placement; nothing else changes."""
    values = schedule_hyperparams(cfg)

    def replace(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if "hyperparams" not in names:
            return leaf
        name = names[names.index("hyperparams") + 1]
        return jax.device_put(jnp.asarray(values[name], leaf.dtype), leaf.sharding)

    return jax.tree_util.tree_map_with_path(replace, state)
