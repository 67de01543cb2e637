"""What the test session's set-up (conftest.py) promises, held: a test
module collected beside the others cannot quietly undo it."""

import os
import pathlib

import jax
import jax.numpy as jnp


def test_programs_compiled_in_the_session_go_to_its_cache():
    """Every process of the session, the pytest-xdist workers included,
    writes what it compiles to the session's one cache directory, so that a
    program compiled again (a new trainer of the same configuration, the
    other worker) is loaded instead. A module that switched the cache off
    at collection would switch it off for every test of that worker."""
    cache = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert cache.name.startswith("zpp-jax-tests-")
    before = set(cache.iterdir())
    # A program no other test compiles (its constants are its own).
    jax.jit(lambda x: x * 7 + 4.125)(jnp.ones(3)).block_until_ready()
    assert set(cache.iterdir()) - before, "nothing was written to the cache"
