"""Choosing a backend: when the program is traced, where the devices are
known, or else when it is lowered."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax


def by_platform(kernel: Callable, reference: Callable, interpret: bool, *args):
    """The Pallas kernel on NVIDIA GPUs, the plain-JAX reference elsewhere;
    with `interpret`, the Pallas kernel in interpret mode anywhere.

    Traced over a mesh of CPU devices (inside a `shard_map` or `use_mesh`
    with a concrete mesh), the program runs on those CPUs, so only the
    reference is traced. (A `jax.export` of such a trace for other platforms
    carries the reference for them too: the same bits, without the kernels'
    speed.) Elsewhere the choice waits for lowering (so one jitted function
    serves every platform), and both are traced: the kernel's trace costs
    about as much as the reference's, and differentiating the call costs both
    again.
    """
    if interpret:
        return kernel(*args, interpret=True)
    if traced_for_platform() == "cpu":
        return reference(*args)
    return lax.platform_dependent(
        *args, cuda=lambda *a: kernel(*a, interpret=False), default=reference
    )


def traced_for_platform() -> str | None:
    """The platform of the devices of the mesh being traced over ("cpu",
    "gpu", ...), or None where the trace names no devices (an abstract mesh
    without a device, or no mesh)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None)
