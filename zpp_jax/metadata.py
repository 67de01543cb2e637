"""Partitioning metadata as the model's author wrote it: Linen's boxes
(`nn.Partitioned`, `nn.LogicallyPartitioned`) and NNX variables'
sharding names (`nnx.with_partitioning`, ``out_sharding``), kept through
`zpp.shard`, `zpp.unshard` and checkpoints.

**Which dimension zpp splits.** A parameter is split along one dimension
over every device (`zpp_jax.mesh.shard_dim`). When its metadata names its
dimensions, each name is turned into mesh axes by the logical axis rules
(MaxText's and t5x's convention: the box's own rules, else those passed to
`zpp.shard`, else those in scope with `nn.logical_axis_rules`; names of an
`nn.Partitioned` are mesh axes already), and zpp splits the first dimension
mapped to an axis in `SHARD_ALONG` (or the ``shard_along`` given), the axis
FSDP shards parameters over. If no dimension is, or the device count does
not divide it, zpp splits the first dimension the count divides, as for a
parameter without metadata. The choice moves only where bytes live: the
computation is the same either way.

**What zpp hands back.** Linen: the same boxes, with the user's names,
around the sharded arrays. NNX: variables whose ``out_sharding`` and
``mesh`` describe the layout zpp stored (so that NNX, which places new
variables by them, puts an optimizer's state where the parameters are);
the author's own are kept under `ORIGINAL` and restored by `zpp.unshard`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import numpy as np
from flax.core import meta
from flax.nnx import Variable
from jax.sharding import Mesh

from zpp_jax.errors import UsageError
from zpp_jax.mesh import MODEL, data_size, model_size, place, shard_dim, spec_along

SHARD_ALONG = ("fsdp", "data")  # mesh axes over which FSDP rules shard parameters
ORIGINAL = "zpp_original_sharding"  # NNX metadata key: the author's sharding metadata
_NNX_KEYS = ("out_sharding", "mesh", "sharding_rules")
Rules = Sequence[tuple[str, Any]] | None


def check_shard_along(shard_along: Sequence[str]) -> tuple[str, ...]:
    if isinstance(shard_along, str) or not all(isinstance(a, str) for a in shard_along):
        raise UsageError(
            f"shard_along={shard_along!r}: give a sequence of mesh axis names, e.g. ('fsdp',)"
        )
    return tuple(shard_along)


def preferred_dim(names, rules: Rules, along: Sequence[str], logical: bool) -> int | None:
    """The first dimension whose `names` entry maps (by `rules`, when
    `logical`) to a mesh axis in `along`; None if none does."""
    if names is None:
        return None
    if logical:
        spec = nn.logical_to_mesh_axes(tuple(names), rules)
        axes = [spec[i] if i < len(spec) else None for i in range(len(names))]
    else:
        axes = list(names)
    for dim, entry in enumerate(axes):
        entry = entry if isinstance(entry, tuple | list) else (entry,)
        if any(a in along for a in entry if a is not None):
            return dim
    return None


# -- Linen boxes --------------------------------------------------------------------------


def is_box(value) -> bool:
    return isinstance(value, meta.AxisMetadata)


def unboxed(value):
    """A parameter's array, out of its box if it has one (no sharding
    constraint applied: zpp places it)."""
    if isinstance(value, meta.Partitioned):
        return value.value
    return value.unbox() if is_box(value) else value


def box_preference(value, rules: Rules, along: Sequence[str]) -> int | None:
    """`preferred_dim` of a Linen parameter, boxed or not."""
    if not isinstance(value, meta.Partitioned):
        return None
    logical = isinstance(value, nn.LogicallyPartitioned)
    own = getattr(value, "rules", None)
    return preferred_dim(value.names, own if own is not None else rules, along, logical)


def reboxed(original, value):
    """`value` in `original`'s box (the same metadata), if it had one."""
    return original.replace_boxed(value) if is_box(original) else value


# -- NNX variables -----------------------------------------------------------------------


def variable_preference(var: Variable, rules: Rules, along: Sequence[str]) -> int | None:
    """`preferred_dim` of an NNX variable with sharding names."""
    names = var.get_metadata("out_sharding", None)
    if names is None:
        return None
    own = var.get_metadata("sharding_rules", None)
    rules = own if own is not None else rules
    return preferred_dim(names, rules, along, logical=bool(rules) or own is not None)


def model_dim(var: Variable, mesh: Mesh, rules: Rules, name: str) -> int | None:
    """The dimension of NNX variable `var` that tensor parallelism splits
    over `mesh`'s `model` axis: the one its sharding names map to `model`;
    None without a `model` axis or such a name.

    Raises:
      UsageError: the degree does not divide that dimension."""
    if model_size(mesh) == 1:
        return None
    dim = variable_preference(var, rules, (MODEL,))
    return _divisible(dim, np.shape(var.get_value()), model_size(mesh), name)


def box_model_dim(value, mesh: Mesh, rules: Rules, name: str) -> int | None:
    """`model_dim` of a Linen parameter, boxed or not."""
    if model_size(mesh) == 1:
        return None
    dim = box_preference(value, rules, (MODEL,))
    return _divisible(dim, np.shape(unboxed(value)), model_size(mesh), name)


def _divisible(dim: int | None, shape: tuple, degree: int, name: str) -> int | None:
    if dim is not None and shape[dim] % degree:
        raise UsageError(
            f"parameter {name} of shape {shape}: the tensor-parallel degree {degree} does not "
            f"divide its dimension {dim} ({shape[dim]}), which its sharding names map to "
            f"'{MODEL}'; use a degree that divides it"
        )
    return dim


def check_model_axis(dims: Sequence[int | None], mesh: Mesh, refused: str | None = None) -> None:
    """Raise UsageError if, on a mesh with a `model` axis, no parameter has
    a dimension its sharding names map to `model` (`dims`, each
    parameter's `model_dim`), or a technique that tensor parallelism does
    not combine with yet (`refused`, its name) is on."""
    degree = model_size(mesh)
    if degree == 1:
        return
    if refused is not None:
        raise UsageError(
            f"a mesh with a '{MODEL}' axis does not yet combine with {refused}: switch it off, "
            "or use a mesh without a model axis"
        )
    if all(d is None for d in dims):
        raise UsageError(
            f"the mesh has a '{MODEL}' axis of size {degree}, but no parameter's sharding names "
            f"map to '{MODEL}', so nothing would be split over it: name the dimensions "
            "(nnx.with_partitioning, nn.with_logical_partitioning) and pass rules that map them "
            f"to it, e.g. rules=[('mlp', '{MODEL}'), ('heads', '{MODEL}')], or use a mesh "
            "without a model axis"
        )


def place_variable(
    var: Variable,
    mesh: Mesh,
    config,
    stacked: bool,
    rules: Rules,
    along: Sequence[str],
    name: str = "",
) -> tuple[int | None, int | None]:
    """Store `var` split over the data-parallel devices of `mesh`
    (`shard_dim`, preferring the dimension its sharding names map to
    `along`) and, with a `model` axis, along the dimension its names map to
    `model` (`model_dim`); its sharding metadata then describes that layout
    (`describe_layout`). Returns (the data dimension, the model dimension)."""
    value = var.get_value()
    prefer = variable_preference(var, rules, along)
    tp = model_dim(var, mesh, rules, name)
    keep = config.persistence_threshold
    dim = shard_dim(np.shape(value), data_size(mesh), stacked, keep, prefer, taken=tp)
    var.set_value(place(value, mesh, dim, tp))
    describe_layout(var, spec_along(np.ndim(value), dim, tp), mesh)
    return dim, tp


def describe_layout(var: Variable, spec, mesh: Mesh) -> None:
    """Set `var`'s sharding metadata to the layout zpp stored it in (`spec`
    on `mesh`), keeping the author's under `ORIGINAL`. Only variables that
    carry sharding names are touched."""
    if var.get_metadata("out_sharding", None) is None:
        return
    if not var.has_metadata(ORIGINAL):  # hashable: NNX keeps metadata in graph definitions
        own = tuple((k, _hashable(var.get_metadata(k, None))) for k in _NNX_KEYS)
        var.set_metadata(ORIGINAL, own)
    ndim = np.ndim(var.get_value())
    var.set_metadata("out_sharding", tuple(spec) + (None,) * (ndim - len(spec)))
    var.set_metadata("mesh", mesh)
    var.set_metadata("sharding_rules", None)


def _hashable(x):
    return tuple(_hashable(v) for v in x) if isinstance(x, list | tuple) else x


def restore_layout(var: Variable) -> None:
    """Undo `describe_layout`: the author's sharding metadata back."""
    if not var.has_metadata(ORIGINAL):
        return
    for key, value in var.get_metadata(ORIGINAL):
        var.set_metadata(key, value)
    var.del_metadata(ORIGINAL)
