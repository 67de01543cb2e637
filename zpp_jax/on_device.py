"""What a unit's own code may do where it runs: on one device's rows of
the batch, inside a `jax.shard_map` over (`node`, `local`).

* Collectives over the model's own name for the data-parallel devices
  (``batch_axis_name``, as models written for ``pmap`` name it) run over
  every device: `with_batch_axis`.
* Logical sharding constraints (``nn.with_logical_constraint``) name a
  layout of the whole batch, which one device's rows have not: dropped
  (`constraints_dropped`).
* What cannot run there (a collective over a name nothing binds, a
  constraint naming mesh axes, another unit's call) is refused with a
  `UsageError` that says what to do: `refused_inside`, `check_not_nested`.
* Random keys are folded with the device index: `fold_keys`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax

from zpp_jax._compat import bind_axis_name
from zpp_jax.errors import UsageError
from zpp_jax.mesh import AXES


def check_batch_axis_name(name: str | None) -> None:
    """Raise UsageError unless `name` is None or an axis name of the
    model's own, not one of the mesh's."""
    if name is None:
        return
    if not isinstance(name, str) or not name:
        raise UsageError(f"batch_axis_name={name!r}: give the model's axis name, a string")
    if name in AXES:
        raise UsageError(
            f"batch_axis_name={name!r} is one of the mesh's own axes {AXES}, which collectives "
            "inside a unit already reach; give the name the model's code uses"
        )


def with_batch_axis(fn: Callable, name: str | None, devices: int) -> Callable:
    """`fn` with its collectives over `name` run over every one of the
    `devices` (`AXES`); `fn` itself when `name` is None. Costs one more
    trace of `fn` where it is traced."""
    return fn if name is None else bind_axis_name(fn, name, AXES, devices)


def constraints_dropped() -> contextlib.AbstractContextManager:
    """A block in which logical sharding constraints map no name to a mesh
    axis, so that each is a constraint to nothing."""
    return nn.logical_axis_rules(())


_UNBOUND = re.compile(r"unbound axis name: (\S+?)\.")


@contextlib.contextmanager
def refused_inside(unit: str) -> Iterator[None]:
    """JAX's errors for what a unit's code cannot do on one device's rows
    (a collective over an axis name nothing binds, a sharding constraint
    naming mesh axes), as UsageErrors that say what to do instead."""
    try:
        yield
    except ValueError as e:
        if "with_sharding_constraint" not in str(e) and "Resource axis" not in str(e):
            raise
        raise UsageError(
            f"unit {unit} constrains the sharding of an array "
            "(jax.lax.with_sharding_constraint, or a logical constraint with rules of its "
            "own): inside a unit each device holds its own rows, so a layout of the whole "
            "batch means nothing there. Constrain outside the units, or use "
            "nn.with_logical_constraint with the rules in scope, which zpp drops inside units"
        ) from None
    except NameError as e:
        found = _UNBOUND.search(str(e))
        if found is None:
            raise
        axis = found.group(1)
        raise UsageError(
            f"unit {unit} runs a collective over the axis name {axis!r} (lax.pmean or "
            f"psum, BatchNorm(axis_name={axis!r}), as a model written for pmap does), which "
            f"nothing binds. If {axis!r} means all the data-parallel devices, pass "
            f"batch_axis_name={axis!r} to zpp.shard or zpp.shard_linen: its collectives then "
            "run over every device, as pmap over all of them would"
        ) from None


def check_not_nested(unit: str, mesh) -> None:
    """Raise UsageError for a unit called inside another unit's call (a
    per-device program over the same devices): there each device holds its
    own rows, and the unit cannot gather its weights over the devices."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if manual & set(mesh.axis_names):
        raise UsageError(
            f"unit {unit} is called inside another unit's call (or a shard_map over the "
            "same devices), where each device runs on its own rows: units must not nest. Make "
            "the outer module the unit and leave this one inside it (a policy that names the "
            "outer one), or call this module outside the other unit"
        )


def fold_keys(values: list, is_key: list, index) -> list:
    """Random keys folded with the device `index` (each key of an array of
    them, as a layer stack splits them per layer), so that every device
    draws its own; anything else as it is."""
    return [_folded(x, index) if k else x for x, k in zip(values, is_key, strict=True)]


def _folded(keys, index):
    if not keys.shape:
        return jax.random.fold_in(keys, index)
    folded = jax.vmap(lambda key: jax.random.fold_in(key, index))(keys.reshape(-1))
    return folded.reshape(keys.shape)
