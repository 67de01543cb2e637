"""The two-level device mesh: `node` (hosts, slow links) x `local` (devices of one host)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zpp_jax.errors import UsageError

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)


def make_mesh(
    nodes: int | None = None,
    local: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Build the (`node`, `local`) mesh.

    With several processes (`jax.distributed`), node = process and local = that
    process's devices: the sizes default to `jax.process_count()` and
    `jax.local_device_count()`, and devices are grouped by process so that the
    `local` axis never crosses a host. In one process (e.g. emulated CPU devices)
    the given sizes split `devices` (default: all of them) node-major.

    Both axes are `Auto` on purpose: the engine addresses them by name inside
    `jax.shard_map`.

    Raises:
      ValueError: sizes that are not positive, or whose product does not equal
        the number of devices, or a `local` axis that would cross processes.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise UsageError("make_mesh got an empty device list")
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
        raise UsageError(
            f"mesh nodes x local = {nodes} x {local} = {nodes * local} does not match the "
            f"{len(devices)} devices available; choose sizes whose product is {len(devices)}, "
            f"or pass devices=jax.devices()[:{nodes * local}]"
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered, dtype=object).reshape(nodes, local)
    if nprocs > 1:
        for row in grid:
            if len({d.process_index for d in row}) != 1:
                raise UsageError(
                    f"the local axis of size {local} would span several processes; with "
                    f"{nprocs} processes use nodes={nprocs} (node = process)"
                )
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def _check_positive(name: str, value: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"mesh size {name} must be a positive int, got {value!r}")


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """(nodes, local) of a mesh built by `make_mesh`."""
    missing = [a for a in AXES if a not in mesh.shape]
    if missing:
        raise UsageError(f"mesh has axes {tuple(mesh.shape)}; the engine needs {AXES}")
    return mesh.shape[NODE], mesh.shape[LOCAL]
