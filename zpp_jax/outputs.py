"""What comes out of a unit: each device's outputs and sown values,
combined into what the unsharded model would have returned, by the rule
its author declared (`zpp.shard(..., outputs=...)`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

from zpp_jax.errors import UsageError
from zpp_jax.paths import is_container, node_at

COMBINES = ("batch", "mean", "sum")
Outputs = str | Callable[[str, str], str | None] | None


class Unit(Protocol):
    """What combining needs of a unit (`zpp_jax.unit.UnitInfo` is one)."""

    name: str  # its path in the model, for messages
    outputs: Outputs  # its author's declaration


def check_outputs(outputs: Outputs) -> None:
    """Raise UsageError unless `outputs` is a declaration `combine_outputs`
    takes: None, "mean", "sum", or a function (unit, output) -> kind."""
    if outputs is None or callable(outputs) or outputs in ("mean", "sum"):
        return
    raise UsageError(
        f"outputs={outputs!r}: give None (units return per-example values only), 'mean' or "
        "'sum' (how every unit's other outputs combine over the devices), or a function "
        "(unit, output) -> 'batch' | 'mean' | 'sum' | None"
    )


def combine_outputs(info: Unit, stacked: tuple, local_batch: int | None) -> tuple:
    """A unit's outputs and sown values from every device's (stacked on a
    leading device axis), by the rule of `zpp_jax.shard.shard`'s `outputs`:

    * "batch": per-example values (leading axis the device's rows), put
      back together into the global batch. The default for every output
      whose leading axis has the rows' length.
    * "mean" / "sum": the mean or the sum over the devices of each device's
      value; exact for a mean or a sum over the batch's rows (each device
      holds as many rows), wrong for anything else (a product of means).
    * a unit called without a batch (no array argument) runs the same on
      every device: its value, device 0's.

    Any other output must be declared: a statistic over the batch computed
    inside a unit is that device's, so it raises UsageError instead.
    """
    out, sown = stacked

    def combine(prefix):
        def one(path, a):
            return _combine(info, prefix + jax.tree_util.keystr(path), a, local_batch)

        return one

    return (
        jax.tree_util.tree_map_with_path(combine("output"), out),
        jax.tree_util.tree_map_with_path(combine("sow"), sown),
    )


def combine_named(info: Unit, stacked: dict, local_batch: int | None) -> dict:
    """Each device's values of `stacked` (name -> value with a leading
    device axis) combined as `combine_outputs` combines an output."""
    return {name: _combine(info, name, a, local_batch) for name, a in stacked.items()}


def _combine(info: Unit, name: str, a: jax.Array, local_batch: int | None) -> jax.Array:
    per_example = local_batch is not None and a.ndim >= 2 and a.shape[1] == local_batch
    if isinstance(info.outputs, str):
        kind = "batch" if per_example else info.outputs
    else:
        kind = info.outputs(info.name, name) if callable(info.outputs) else None
        if kind not in (None, *COMBINES):
            raise UsageError(
                f"outputs({info.name!r}, {name!r}) returned {kind!r}; return one of {COMBINES} "
                "or None (per-example if its leading axis is the batch's)"
            )
    if kind is None and local_batch is None:
        return a[0]  # no batch: the same on every device
    if kind is None and not per_example:
        raise UsageError(_not_per_example(info, name, a, local_batch))
    if kind in (None, "batch"):
        if not per_example:
            raise UsageError(
                f"unit {info.name}: {name} is declared 'batch' but has shape {a.shape[1:]}, "
                f"whose leading axis is not this device's {local_batch} rows"
            )
        return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])
    if kind == "mean" and not jnp.issubdtype(a.dtype, jnp.floating):
        raise UsageError(
            f"unit {info.name}: {name} is {a.dtype.name} and cannot be averaged over the "
            "devices; declare it 'sum' (a count), or return it per example"
        )
    reduce = jnp.mean if kind == "mean" else jnp.sum
    return reduce(a.astype(jnp.float32) if kind == "mean" else a, axis=0).astype(a.dtype)


def append_sown(info: Unit, name: str, have, new):
    """A value sown again (the unit called twice): appended, as sow's
    default tuple reduction does; any other reduction is refused."""
    if isinstance(have, tuple) and isinstance(new, tuple):
        return have + new
    raise UsageError(
        f"unit {info.name} sowed {name} again with a reduction other than sow's default "
        "(a tuple); zpp cannot apply another reduction across devices: sow with the default, "
        "or reduce the tuple after the call"
    )


def _not_per_example(info: Unit, name: str, a: jax.Array, local_batch: int) -> str:
    return (
        f"unit {info.name} returned {name} of shape {a.shape[1:]} ({a.dtype.name}), which is "
        f"not per example (its leading axis is not this device's {local_batch} rows of the "
        "batch). A unit runs on each device's rows, so a statistic of the batch computed "
        "inside it is that device's alone. Return per-example values and reduce them "
        "outside the unit, or declare how it combines over the devices: zpp.shard(..., "
        "outputs='mean') is exact for a mean over the rows, 'sum' for a sum over them, or a "
        "function (unit, output) -> 'batch' | 'mean' | 'sum' | None for each output"
    )


# -- NNX's sown values ------------------------------------------------------------


def emptied_sown(info: Unit, path, value):
    """A sown value as it is before any sow: each device's call then sows
    only its own values, which are combined and appended afterwards."""
    if isinstance(value, dict):  # nnx.capture's record: one dict per variable type
        return {}
    if isinstance(value, tuple):  # sow's default reduction
        return ()
    raise UsageError(
        f"unit {info.name} holds the sown value {'/'.join(map(str, path))} from an earlier call, "
        f"reduced to a {type(value).__name__}; zpp merges sown values across devices only with "
        "sow's default tuple reduction: use nnx.capture, or nnx.pop(model, nnx.Intermediate) "
        "between calls"
    )


def merge_sown(module, info: Unit, path, var_type: type, key, value) -> None:
    """Add what one call of a unit sowed (combined over the devices) to
    `module`, as sow's default reduction would: tuples appended. `key`: the
    entry of an `nnx.capture` record (a dict) at `path`, None for a sown
    attribute."""
    owner = node_at(module, path[:-1])
    var = owner[path[-1]] if is_container(owner) else getattr(owner, path[-1], None)
    if var is None:
        setattr(owner, path[-1], var_type(value))
    elif key is None:
        var.set_value(append_sown(info, path[-1], var.get_value(), value))
    else:
        record = dict(var.get_value())
        record[key] = append_sown(info, key, record[key], value) if key in record else value
        var.set_value(record)
