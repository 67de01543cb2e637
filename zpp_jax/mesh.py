"""The two-level device mesh: `node` (hosts, slow links) x `local` (devices
of one host); with tensor parallelism, a `model` axis after them (the
devices of one host that split each layer's matrices); with a token
pipeline, a `stage` axis in front."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.errors import UsageError

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)  # the data-parallel axes, over which ZeRO++ shards
MODEL = "model"  # the tensor-parallel axis, which XLA partitions
STAGE = "stage"


def make_mesh(
    nodes: int | None = None,
    local: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    model: int = 1,
) -> Mesh:
    """Build the (`node`, `local`) mesh, or with ``model > 1`` the (`node`,
    `local`, `model`) mesh of tensor parallelism.

    With several processes (`jax.distributed`), node = process and local = that
    process's devices: the sizes default to `jax.process_count()` and
    `jax.local_device_count()`, and devices are grouped by process so that the
    `local` axis never crosses a host. In one process (e.g. emulated CPU devices)
    the given sizes split `devices` (default: all of them) node-major.

    `model`: the tensor-parallel degree, the innermost axis, so that a
    layer's matrices are split among devices of one host (NVLink) and ZeRO++
    runs over (`node`, `local`): a process holds ``local x model`` devices.

    All axes are `Auto` on purpose: the engine addresses `node` and `local` by
    name inside `jax.shard_map`, and XLA partitions `model`.

    Raises:
      ValueError: sizes that are not positive, or whose product does not equal
        the number of devices, or a `local` axis that would cross processes.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise UsageError("make_mesh got an empty device list")
    _check_positive("model", model)
    if model > 1:
        return _tensor_parallel_mesh(nodes, local, model, devices)
    nprocs = len({d.process_index for d in devices})
    if nodes is None and local is None:
        nodes = nprocs
    if nodes is None or local is None:
        given_name, given = ("local", local) if nodes is None else ("nodes", nodes)
        _check_positive(given_name, given)
        if len(devices) % given:
            raise UsageError(
                f"mesh {given_name}={given} does not match the {len(devices)} devices "
                f"available: it must divide {len(devices)}"
            )
        other = len(devices) // given
        nodes, local = (other, local) if nodes is None else (nodes, other)
    _check_positive("nodes", nodes)
    _check_positive("local", local)
    if nodes * local != len(devices):
        fewer = f", or pass devices=jax.devices()[:{nodes * local}]"
        raise UsageError(
            f"mesh nodes x local = {nodes} x {local} = {nodes * local} does not match the "
            f"{len(devices)} devices available; choose sizes whose product is {len(devices)}"
            + (fewer if nodes * local < len(devices) else "")
        )
    grid = _process_major(devices, (nodes, local))
    if grid is None:
        raise UsageError(
            f"the local axis of size {local} would span several processes; with "
            f"{nprocs} processes use nodes={nprocs} (node = process)"
        )
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def _tensor_parallel_mesh(nodes, local, model: int, devices: list) -> Mesh:
    """The (`node`, `local`, `model`) mesh: `make_mesh` over groups of
    `model` consecutive devices of one process."""
    if len(devices) % model:
        raise UsageError(f"mesh model={model} does not divide the {len(devices)} devices available")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    groups = [ordered[i : i + model] for i in range(0, len(ordered), model)]
    if any(len({d.process_index for d in g}) != 1 for g in groups):
        raise UsageError(
            f"the model axis of size {model} would span several processes: it must divide "
            "each process's device count"
        )
    try:
        leaders = make_mesh(nodes, local, [g[0] for g in groups])
    except UsageError as e:
        raise UsageError(f"{e} (after model={model} devices per group)") from None
    first = {g[0]: g for g in groups}
    grid = np.array([[first[d] for d in row] for row in leaders.devices], dtype=object)
    axes = (*AXES, MODEL)
    return Mesh(grid.reshape(*leaders.devices.shape, model), axes, axis_types=(AxisType.Auto,) * 3)


def make_pipeline_mesh(
    stages: int, nodes: int, local: int, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """The (`stage`, `node`, `local`) mesh of a token pipeline whose stages
    each span `nodes` x `local` devices.

    Devices are ordered by process, then id: with several processes, stage s
    holds processes [s * nodes, (s + 1) * nodes), one per node, so that the
    pipeline's activation transfers go between processes and a stage's ZeRO
    collectives stay among its own.

    Raises:
      ValueError: sizes that are not positive, a product that is not the
        number of devices, or a `local` axis that would cross processes.
    """
    for name, value in (("stages", stages), ("nodes", nodes), ("local", local)):
        _check_positive(name, value)
    devices = list(jax.devices() if devices is None else devices)
    if stages * nodes * local != len(devices):
        raise UsageError(
            f"pipeline mesh stages x nodes x local = {stages} x {nodes} x {local} = "
            f"{stages * nodes * local} does not match the {len(devices)} devices available; "
            f"choose sizes whose product is {len(devices)}"
        )
    grid = _process_major(devices, (stages, nodes, local))
    if grid is None:
        nprocs = len({d.process_index for d in devices})
        raise UsageError(
            f"the local axis of size {local} would span several processes; with {nprocs} "
            f"processes use stages x nodes = {nprocs} (node = process)"
        )
    return Mesh(grid, (STAGE, *AXES), axis_types=(AxisType.Auto,) * 3)


def _process_major(devices: Sequence[jax.Device], shape: tuple[int, ...]):
    """`devices` ordered by process, then id, as an array of `shape`; None
    when a row of its last (`local`) axis would hold devices of two
    processes."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered, dtype=object).reshape(shape)
    rows = grid.reshape(-1, shape[-1])
    return None if any(len({d.process_index for d in row}) != 1 for row in rows) else grid


def _check_positive(name: str, value: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"mesh size {name} must be a positive int, got {value!r}")


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """(nodes, local) of a mesh built by `make_mesh`.

    Raises:
      UsageError: `mesh` is not a `jax.sharding.Mesh`, or lacks the axes.
    """
    if not isinstance(mesh, Mesh):
        raise UsageError(
            f"mesh must be a jax.sharding.Mesh with axes {AXES} (zpp.make_mesh(nodes, local)), "
            f"got {type(mesh).__name__}"
        )
    missing = [a for a in AXES if a not in mesh.shape]
    if missing:
        raise UsageError(f"mesh has axes {tuple(mesh.shape)}; the engine needs {AXES}")
    return mesh.shape[NODE], mesh.shape[LOCAL]


def model_size(mesh: Mesh) -> int:
    """The tensor-parallel degree of `mesh`: its `model` axis (1 without one)."""
    return mesh.shape.get(MODEL, 1)


def data_size(mesh: Mesh) -> int:
    """N, the data-parallel devices ZeRO++ shards over: nodes x local."""
    nodes, local = mesh_shape(mesh)
    return nodes * local


def devices_per_node(mesh: Mesh) -> int:
    """A node's devices: local x model, the axes inside `node` (a device's
    node is its position in `mesh.devices`, row-major, divided by this; a
    pipeline's stages, outside `node`, are nodes of their own)."""
    _, local = mesh_shape(mesh)
    return local * model_size(mesh)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches for a `shard`ed model: the leading axis over every device."""
    mesh_shape(mesh)
    return NamedSharding(mesh, P(AXES))


def on_mesh(tree, mesh: Mesh):
    """`tree` with its arrays that live on one device (an optimizer's step
    counters, which `nnx.Optimizer` and `optax` create on the default
    device) replicated over `mesh`; arrays already on the mesh are kept.
    A graph node (an `nnx.Optimizer`, a module) is updated in place and
    returned. Why: after one step those counters come back replicated, and
    `jax.jit` / `nnx.jit` would trace and compile the step a second time.
    Costs a copy of each such (scalar) array."""
    mesh_shape(mesh)
    replicated = NamedSharding(mesh, P())

    def place(a):
        if isinstance(a, jax.Array) and not isinstance(a.sharding, NamedSharding):
            return jax.device_put(a, replicated)
        return a

    if isinstance(tree, nnx.Pytree):
        nnx.update(tree, jax.tree.map(place, nnx.state(tree)))
        return tree
    return jax.tree.map(place, tree)


def whole_on(mesh: Mesh, f: Callable) -> Callable:
    """`f` with its argument and result whole on every device of `mesh`.
    For the slices and concatenations of a flat vector, which partitioned
    along the vector are programs of halo exchanges, many times longer to
    compile than one all-gather (or none, for an argument already whole)."""
    whole = NamedSharding(mesh, P())

    def f_whole(x):
        return jax.lax.with_sharding_constraint(
            f(jax.lax.with_sharding_constraint(x, whole)), whole
        )

    return f_whole


def shard_dim(
    shape: tuple[int, ...],
    n: int,
    stacked: bool,
    keep_below: int = 0,
    prefer: int | None = None,
    taken: int | None = None,
) -> int | None:
    """The dimension a parameter is split along: `prefer` (a dimension its
    partitioning metadata names) if N divides it, else the first one (after
    a stack's layer axis) that N divides, so that a block is a contiguous
    run; None (kept whole on every device) when none does, or when it holds
    fewer than `keep_below` elements (per layer of a stack). Never `taken`
    (the dimension tensor parallelism splits)."""
    first = 1 if stacked and len(shape) > 1 else 0
    if math.prod(shape[first:]) < keep_below:
        return None
    if prefer not in (None, taken) and first <= prefer < len(shape) and shape[prefer] % n == 0:
        return prefer
    for d in range(first, len(shape)):
        if d != taken and shape[d] % n == 0:
            return d
    return None


def spec_along(ndim: int, dim: int | None, model_dim: int | None = None) -> P:
    """The PartitionSpec that splits dimension `dim` over the data-parallel
    devices (`node`, `local`) and `model_dim` over `model`."""
    if dim is None and model_dim is None:
        return P()
    return P(*[AXES if i == dim else MODEL if i == model_dim else None for i in range(ndim)])


def place(
    value, mesh: Mesh, dim: int | None, model_dim: int | None = None
) -> jax.Array | jax.ShapeDtypeStruct:
    """`value` stored split along `dim` over the data-parallel devices of
    `mesh` and along `model_dim` over its `model` axis (whole on every
    device when both are None). An abstract value (a
    `jax.ShapeDtypeStruct`, as `nnx.eval_shape` makes) stays abstract and
    gains the sharding: nothing is allocated, so a model can be sharded for
    devices that only exist to compile for."""
    sharding = NamedSharding(mesh, spec_along(np.ndim(value), dim, model_dim))
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    if (dim, model_dim) != (None, None) and _in_cpu_memory(value):
        # The same copies, cut by numpy from a view of the array: XLA would
        # compile a slicing program for every shape it splits.
        value = np.asarray(value)
    return jax.device_put(value, sharding)


def _in_cpu_memory(value) -> bool:
    """Whether `value` is a jax.Array of numbers held whole in this host's
    memory (on one CPU device), so that numpy can view it without a copy."""
    return (
        isinstance(value, jax.Array)
        and len(value.sharding.device_set) == 1
        and next(iter(value.sharding.device_set)).platform == "cpu"
        and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended)
    )
