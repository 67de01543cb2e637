"""Shared fixtures: 8 emulated CPU devices, meshes, and a small transformer stack."""

import os

# Must run before jax is imported anywhere in the test session.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from zpp_jax import make_mesh  # noqa: E402


@pytest.fixture(scope="session", params=[(2, 4), (4, 2)], ids=["2x4", "4x2"])
def mesh(request):
    return make_mesh(*request.param)


@pytest.fixture(scope="session")
def mesh24():
    return make_mesh(2, 4)
