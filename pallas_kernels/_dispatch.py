"""Choosing a backend at lowering time."""

from __future__ import annotations

from collections.abc import Callable

from jax import lax


def by_platform(kernel: Callable, reference: Callable, interpret: bool, *args):
    """The Pallas kernel on NVIDIA GPUs, the plain-JAX reference elsewhere
    (decided when the program is lowered, so one jitted function serves every
    platform); with `interpret`, the Pallas kernel in interpret mode anywhere."""
    if interpret:
        return kernel(*args, interpret=True)
    return lax.platform_dependent(
        *args, cuda=lambda *a: kernel(*a, interpret=False), default=reference
    )
