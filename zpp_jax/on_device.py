"""What a unit's own code may do where it runs: on one device's rows of
the batch, inside a `jax.shard_map` over (`node`, `local`).

* Collectives over the model's own name for the data-parallel devices
  (``batch_axis_name``, as models written for ``pmap`` name it) run over
  every device: `with_batch_axis`.
* Logical sharding constraints (``nn.with_logical_constraint``) name a
  layout of the whole batch, which one device's rows have not: dropped.
* Sharding constraints that name mesh axes (``jax.lax.with_sharding_constraint``,
  as models written for ``jax.jit`` over a (`data`, `model`) mesh call
  it) are mapped onto the unit's mesh: their data-parallel parts hold by
  construction (each device holds its own rows) and are dropped, their
  tensor-parallel parts become the layout along `model`
  (`constraints_on_device`, `constraint_axes`).
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
from jax.sharding import NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from zpp_jax._compat import bind_axis_name, sharding_constraints_routed
from zpp_jax.errors import UsageError
from zpp_jax.mesh import AXES, MODEL, model_size


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


def constraint_axes(rules, along) -> tuple[tuple[str, str | None], ...]:
    """Where each mesh-axis name a unit's sharding constraints may use lands
    on the unit's mesh: `MODEL`, or None (a data-parallel axis). `model`
    is itself; zpp's (`node`, `local`) and `along` (the axes FSDP shards
    over: ``fsdp``, ``data``) are data axes; a name the logical `rules`
    map (the first rule for it, as Flax reads them) lands where its axes
    do. Names none of these reach are not listed: a constraint naming one
    is refused (`constraints_on_device`)."""
    known: dict[str, str | None] = {MODEL: MODEL, **dict.fromkeys((*AXES, *along))}
    mapped: dict[str, str | None] = {}
    for name, target in rules or ():
        axes = [a for a in (target if isinstance(target, tuple | list) else (target,)) if a]
        if name in mapped or not all(a in known for a in axes):
            continue
        mapped[name] = MODEL if MODEL in [known[a] for a in axes] else None
    return tuple({**known, **mapped}.items())


@contextlib.contextmanager
def constraints_on_device(info) -> Iterator[None]:
    """The block a unit's code runs in (`info`, its `UnitInfo`): logical
    sharding constraints map no name to a mesh axis (each is a constraint
    to nothing), and ``jax.lax.with_sharding_constraint`` maps its mesh-axis
    names by ``info.constraint_axes`` (`constraint_axes`): on a mesh with a
    `model` axis the constraint then holds along it (replicated over it
    where no name lands there, as the author's spec says); without one,
    nothing is left to constrain. Costs nothing at run time.

    Raises (as the unit's code calls it):
      UsageError: a constraint names an axis `axes` does not reach, or is
        not a PartitionSpec or NamedSharding."""
    unit, axes = info.name, dict(info.constraint_axes)
    tensor_parallel = model_size(info.mesh) > 1

    def route(x, shardings, original):
        specs = jax.tree.map(
            lambda s: _local_spec(s, axes, unit),
            shardings,
            is_leaf=lambda s: s is None or isinstance(s, P | Sharding),
        )
        return original(x, specs) if tensor_parallel else x

    with nn.logical_axis_rules(()), sharding_constraints_routed(route):
        yield


def _local_spec(sharding, axes: dict, unit: str) -> P | None:
    """`sharding` (the author's) as a spec over the unit's mesh."""
    if sharding is None:
        return None
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    if not isinstance(spec, P):
        raise UsageError(
            f"unit {unit} constrains an array to a {type(sharding).__name__}; inside a unit "
            "zpp maps a PartitionSpec or a NamedSharding (mesh-axis names) onto its mesh"
        )
    return P(*(_local_entry(entry, axes, unit) for entry in spec))


def _local_entry(entry, axes: dict, unit: str):
    if entry is None or entry is P.UNCONSTRAINED:
        return entry
    names = entry if isinstance(entry, tuple) else (entry,)
    for name in names:
        if name not in axes:
            raise UsageError(
                f"unit {unit} constrains an array along the mesh axis {name!r}, which zpp's mesh "
                f"{tuple(axes)} does not reach: pass rules that map it, e.g. "
                f"rules=[({name!r}, 'model')] for a tensor-parallel axis or [({name!r}, None)] "
                "for a data-parallel one, to zpp.shard"
            )
    return MODEL if MODEL in [axes[n] for n in names] else None


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
            f"unit {unit} constrains the sharding of an array in a way zpp cannot map onto "
            "its mesh (a with_sharding_constraint the model imported as a name, not called as "
            "jax.lax.with_sharding_constraint): inside a unit each device holds its own rows. "
            "Call it as jax.lax.with_sharding_constraint, whose mesh-axis names zpp maps, "
            "constrain outside the units, or use nn.with_logical_constraint with the rules "
            "in scope, which zpp drops inside units"
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
