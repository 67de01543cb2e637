"""zpp_jax._compat: every use of JAX's internals names the JAX versions it
was checked on, those versions cover the declared range, and what the seam
asks of the installed jaxlib (its XLA flags and compile options, its scan)
is answered by that jaxlib."""

import importlib.metadata
import inspect
import warnings

import jax
import jax.numpy as jnp
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from zpp_jax import _compat


def _declared(name: str):
    (spec,) = [
        Requirement(r).specifier
        for r in importlib.metadata.requires("zpp-jax")
        if Requirement(r).name == name and not Requirement(r).marker
    ]
    return spec


def _public_seam():
    """The public functions `_compat` defines (`checked_on` aside)."""
    return [
        fn
        for name, fn in inspect.getmembers(_compat, inspect.isfunction)
        if fn.__module__ == _compat.__name__
        and fn is not _compat.checked_on
        and not name.startswith("_")
    ]


def test_every_function_of_the_seam_names_the_versions_it_was_checked_on():
    unnamed = [fn.__name__ for fn in _public_seam() if not getattr(fn, "jax_checked_on", ())]
    assert unnamed == [] and len(_public_seam()) >= 15


def test_the_installed_jax_is_declared_and_checked():
    """CI runs the suite on the newest JAX the index serves and the quick
    loop on the lowest declared: a version that either run installs and that
    some function was not checked on fails here, naming the function."""
    version = jax.__version__
    assert importlib.metadata.version("jaxlib") == version
    assert _declared("jax").contains(version) and _declared("jaxlib").contains(version)
    unchecked = [fn.__name__ for fn in _public_seam() if version not in fn.jax_checked_on]
    assert unchecked == [], f"not checked on jax {version}: {unchecked}"


def test_every_declared_minor_version_is_checked():
    """The declared range's lowest version, and a version of each minor
    release it admits, are among the versions each function names."""
    spec = _declared("jax")
    lowest = min(Version(s.version) for s in spec if s.operator == ">=")
    below = min(Version(s.version) for s in spec if s.operator == "<")
    minors = {(0, m) for m in range(lowest.minor, below.minor)} if below.major == 0 else None
    assert minors, f"the declared range {spec} has no upper bound below 1.0 to check against"
    for fn in _public_seam():
        checked = [Version(v) for v in fn.jax_checked_on]
        assert lowest in checked, (fn.__name__, str(lowest))
        assert {(v.major, v.minor) for v in checked} >= minors, (fn.__name__, sorted(minors))


def test_scan_carry_reads_the_loop():
    def body(carry, x):
        a, b = carry
        return (a + x, b * 2), a

    closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(body, c, xs))((1.0, 2.0), jnp.ones(3))
    (eqn,) = [e for e in closed.jaxpr.eqns if _compat.is_scan(e)]
    # No constants; two carries; one scanned input and one stacked output.
    assert _compat.scan_carry(eqn) == (2, 2)
    assert len(eqn.invars) == 3 and len(eqn.outvars) == 3


def test_an_xla_flag_this_jaxlib_lacks_is_left_out_without_aborting():
    known, lacking = _compat.known_xla_flags(
        ["--xla_backend_optimization_level=0", "--xla_zpp_no_such_flag=1"]
    )
    assert known == ["--xla_backend_optimization_level=0"]
    assert lacking == ["--xla_zpp_no_such_flag=1"]
    assert _compat.known_xla_flags([]) == ([], [])


def test_a_compile_option_this_jaxlib_lacks_is_left_out_with_a_warning():
    options = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_zpp_no_such_option": 1}
    with pytest.warns(UserWarning, match="lacks the compile options xla_zpp_no_such_option"):
        kept = _compat.known_compile_options(options)
    assert kept == {"xla_gpu_enable_latency_hiding_scheduler": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.known_compile_options(kept) == kept
