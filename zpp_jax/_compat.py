"""The one seam between zpp-jax and JAX's internals.

Every private JAX import, every primitive zpp-jax defines and every edit of
a jaxpr's equations goes through this module, so that a new JAX version is
met in one file. Written against jax 0.10.2, the version the package
declares and CI tests; each function names what it relies on.

Known changes after 0.10: jax 0.11 replaces `scan`'s ``num_consts`` and
``num_carry`` parameters (`scan_carry` and `unrolled_scan_with_carry`
read and write them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

# Dead-code elimination of a jaxpr, and its closed-over constants made
# inputs: the two transformations `zpp_jax.residuals` needs, from JAX's
# partial evaluator (no public equivalent).
from jax._src.interpreters.partial_eval import (  # noqa: F401 - re-exported
    convert_constvars_jaxpr,
    dce_jaxpr,
)
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive, Var
from jax.interpreters import ad, batching, mlir

# -- primitives of zpp-jax's own -------------------------------------------------------


def source_primitive(name: str, make: Callable[..., jax.Array]) -> Primitive:
    """A primitive without operands whose value is ``make(**params)``, kept
    as one equation in a jaxpr (so a rewrite can find it by identity),
    lowered as `make`'s operations. Not differentiable (it has no inputs)."""
    p = Primitive(name)
    p.def_impl(make)
    p.def_abstract_eval(lambda **params: jax.core.ShapedArray(*_shape_dtype(make, params)))
    mlir.register_lowering(p, mlir.lower_fun(make, multiple_results=False))
    return p


def _shape_dtype(make, params):
    out = jax.eval_shape(lambda: make(**params))
    return out.shape, out.dtype


def identity_primitive(name: str) -> Primitive:
    """A primitive that returns its operand, kept as one equation in a jaxpr
    and compiled away: linear (its cotangent passes through), vectorized
    under `jax.vmap`."""
    p = Primitive(name)
    p.def_impl(lambda x: x)
    p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x, multiple_results=False))
    ad.deflinear2(p, lambda ct, x: [ct])
    batching.defvectorized(p)
    return p


# -- jaxpr equations ---------------------------------------------------------------------

# Primitives whose parameters hold jaxprs that run as they are: calls, and
# the bodies of loops and remat regions.
_CALLS = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "scan")


def map_inner_jaxprs(eqn: JaxprEqn, fn: Callable[[Jaxpr], Jaxpr]) -> JaxprEqn:
    """`eqn` with `fn` applied to every jaxpr its parameters hold (a call's,
    a loop's body); the same object when `fn` changed none."""
    if eqn.primitive.name not in _CALLS:
        return eqn
    params = {k: _mapped(v, fn) for k, v in eqn.params.items()}
    if all(params[k] is v for k, v in eqn.params.items()):
        return eqn
    return eqn.replace(params=params)


def _mapped(value: Any, fn: Callable[[Jaxpr], Jaxpr]) -> Any:
    if isinstance(value, ClosedJaxpr):
        inner = fn(value.jaxpr)
        return value if inner is value.jaxpr else ClosedJaxpr(inner, value.consts)
    if isinstance(value, Jaxpr):
        return fn(value)
    return value


def is_scan(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name == "scan"


def scan_body(eqn: JaxprEqn) -> ClosedJaxpr:
    """A `scan` equation's loop body."""
    return eqn.params["jaxpr"]


def scan_carry(eqn: JaxprEqn) -> tuple[int, int]:
    """(The index among a `scan`'s operands, and among its body's inputs,
    just after the last carry; the index among its results, and its body's
    outputs, just after the last carry.)"""
    return eqn.params["num_consts"] + eqn.params["num_carry"], eqn.params["num_carry"]


def unrolled_scan_with_carry(eqn: JaxprEqn, body: Jaxpr, first: Var, last: Var) -> JaxprEqn:
    """`eqn` (a `scan`) fully unrolled, running `body`, which takes and
    returns one more carry after the others: `first` in, `last` out.
    `body`'s `debug_info` must already name the new carry
    (`with_carry_names`)."""
    at_in, at_out = scan_carry(eqn)
    return eqn.replace(
        invars=[*eqn.invars[:at_in], first, *eqn.invars[at_in:]],
        outvars=[*eqn.outvars[:at_out], last, *eqn.outvars[at_out:]],
        params={
            **eqn.params,
            "jaxpr": ClosedJaxpr(body, scan_body(eqn).consts),
            "num_carry": eqn.params["num_carry"] + 1,
            "unroll": max(int(eqn.params["length"]), 1),
        },
    )


def with_carry_names(body: Jaxpr, at_in: int, at_out: int, name: str):
    """`body`'s `debug_info` with one more argument at `at_in` and one more
    result at `at_out`, both called `name`."""
    info = body.debug_info
    if info is None:
        return None
    names, paths = info.arg_names, info.result_paths
    return info._replace(
        arg_names=None if names is None else (*names[:at_in], name, *names[at_in:]),
        result_paths=(
            (*paths[:at_out], name, *paths[at_out:]) if isinstance(paths, tuple) else paths
        ),
    )


def new_var(like: Var) -> Var:
    """A fresh variable of `like`'s abstract value."""
    return Var(like.aval)


def opaque_trace_state() -> Any:
    """An object equal for two calls in the same trace, and only then."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


def is_tracer(x: Any) -> bool:
    """Whether `x` is a value being traced (not a concrete array)."""
    return isinstance(x, jax.core.Tracer)


# -- multi-process jobs ------------------------------------------------------------------


def coordination_client():
    """The client of JAX's coordination service in this process (None before
    `jax.distributed.initialize`): what answers which processes are alive
    and holds barriers. From `jax._src.distributed`, no public equivalent."""
    from jax._src import distributed

    return distributed.global_state.client


# -- axis names -------------------------------------------------------------------------

# Parameters of the collectives (psum, pmax, all_gather, ppermute, all_to_all,
# psum_scatter, axis_index) that name the axes they run over.
_AXIS_PARAMS = ("axes", "axis_name")


def bind_axis_name(fn: Callable, name: str, axes: tuple[str, ...], size: int) -> Callable:
    """`fn` with every collective over the axis `name` run over `axes`
    instead (`size` devices together), where `name` is not bound.

    `fn` is traced with `name` bound to `size` (``jax.make_jaxpr``'s
    ``axis_env``, so that a mean over it divides by `size`), the axis renamed
    in its jaxpr and those it calls (jit, scan, cond, while, remat), and the
    result evaluated. Collectives inside a ``custom_vjp``'s backward rule
    are not reached. Relies on the collectives' parameter names
    (`_AXIS_PARAMS`) and on `jax.core.eval_jaxpr`."""

    def bound(*args):
        closed, shape = jax.make_jaxpr(fn, axis_env=[(name, size)], return_shape=True)(*args)
        jaxpr = _renamed(closed.jaxpr, name, axes)
        out = jax.core.eval_jaxpr(jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    return bound


def _renamed(jaxpr: Jaxpr, name: str, axes: tuple[str, ...]) -> Jaxpr:
    eqns = [_renamed_eqn(e, name, axes) for e in jaxpr.eqns]
    if all(a is b for a, b in zip(eqns, jaxpr.eqns, strict=True)):
        return jaxpr
    return jaxpr.replace(eqns=eqns)


def _renamed_eqn(eqn: JaxprEqn, name: str, axes: tuple[str, ...]) -> JaxprEqn:
    params = {k: _renamed_param(k, v, name, axes) for k, v in eqn.params.items()}
    if all(params[k] is v for k, v in eqn.params.items()):
        return eqn
    return eqn.replace(params=params)


def _renamed_param(key: str, value: Any, name: str, axes: tuple[str, ...]) -> Any:
    if isinstance(value, ClosedJaxpr):
        inner = _renamed(value.jaxpr, name, axes)
        return value if inner is value.jaxpr else ClosedJaxpr(inner, value.consts)
    if isinstance(value, Jaxpr):
        return _renamed(value, name, axes)
    if isinstance(value, tuple) and any(isinstance(v, ClosedJaxpr | Jaxpr) for v in value):
        new = tuple(_renamed_param(key, v, name, axes) for v in value)
        return value if all(a is b for a, b in zip(new, value, strict=True)) else new
    if key not in _AXIS_PARAMS:
        return value
    if value == name:
        return axes
    if isinstance(value, tuple) and name in value:
        return tuple(a for v in value for a in (axes if v == name else (v,)))
    return value
