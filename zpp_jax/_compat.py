"""The one seam between zpp-jax and JAX's internals.

Every private JAX import, every primitive zpp-jax defines, every edit of
a jaxpr's equations and every XLA option whose name depends on the jaxlib
goes through this module, so that a new JAX version is met in one file.

Each function names the JAX versions it was read against and tested on
(`checked_on`); ``tests/test_compat.py`` fails when the installed JAX, or
the lowest version the package declares, is not among them. CI runs the
tests on both ends of the declared range.

What changed between the versions this module has met:

* jax 0.11 replaced `scan`'s ``num_consts`` and ``num_carry`` parameters
  with ``ft_in`` and ``ft_out``, flat trees (``jax._src.flattree``) of
  (constants, carry, scanned inputs) and (carry, stacked outputs)
  (`scan_carry` and `unrolled_scan_with_carry` read and write them).
* jaxlib 0.11 dropped the XLA flag ``--xla_cpu_use_fusion_emitters``
  (XLA aborts a process whose ``XLA_FLAGS`` names a flag it lacks:
  `known_xla_flags` keeps such flags out) and the GPU options
  ``xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}``, now
  ``xla_gpu_pipeline_*`` (`zpp_jax.overlap.options`).
* jaxlib 0.12.1 hangs a multi-process CPU job (gloo) in its first
  collective when a process loads the program from the persistent
  compilation cache: whether the others load it too or compile it
  (`cached_programs_hang_cpu_jobs`; `zpp_jax.distributed.initialize`
  turns the cache off for such a job, and says so).
* jaxlib 0.11.2 (fixed in 0.12) crashes the process while compiling a
  program in which a zero-size array enters a ``shard_map`` (an empty
  index array closed over by its body, as the transpose of a scatter into
  a static slice makes): Shardy's canonicalization of the manual
  computation's unused operands. zpp-jax's own code makes no such array
  (the pipeline pads where it scattered).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import jax
from jax._src import flattree
from jax._src.interpreters import partial_eval
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive, Var
from jax.interpreters import ad, batching, mlir

_F = TypeVar("_F", bound=Callable)


def checked_on(*versions: str) -> Callable[[_F], _F]:
    """Mark a function as read against, and tested on, these JAX versions
    (``jax.__version__`` strings)."""

    def mark(fn: _F) -> _F:
        fn.jax_checked_on = versions
        return fn

    return mark


# -- transformations of JAX's partial evaluator ------------------------------------------


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def dce_jaxpr(jaxpr: Jaxpr, used_outputs: list[bool]) -> tuple[Jaxpr, list[bool]]:
    """`jaxpr` with only what `used_outputs` need, and which of its inputs
    that still reads. From ``jax._src.interpreters.partial_eval`` (no public
    equivalent)."""
    return partial_eval.dce_jaxpr(jaxpr, used_outputs)


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def convert_constvars_jaxpr(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr` with its closed-over constants made its first inputs. From
    ``jax._src.interpreters.partial_eval`` (no public equivalent)."""
    return partial_eval.convert_constvars_jaxpr(jaxpr)


# -- primitives of zpp-jax's own -------------------------------------------------------


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
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


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
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
_CALLS = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2", "scan")


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
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


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def is_scan(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name == "scan"


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def fully_unrolled_scan(eqn: JaxprEqn) -> JaxprEqn:
    """A `scan` equation that lowers with every iteration in line and no
    loop (``unroll=0``, as ``jax.lax.scan(..., unroll=0)`` binds it)."""
    return eqn.replace(params={**eqn.params, "unroll": 0})


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def scan_body(eqn: JaxprEqn) -> ClosedJaxpr:
    """A `scan` equation's loop body."""
    return eqn.params["jaxpr"]


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def scan_carry(eqn: JaxprEqn) -> tuple[int, int]:
    """(The index among a `scan`'s operands, and among its body's inputs,
    just after the last carry; the index among its results, and its body's
    outputs, just after the last carry.) Reads the ``ft_in`` parameter
    (constants, carry, scanned inputs)."""
    consts, carry, _ = eqn.params["ft_in"].unpack()
    return len(consts) + len(carry), len(carry)


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def unrolled_scan_with_carry(eqn: JaxprEqn, body: Jaxpr, first: Var, last: Var) -> JaxprEqn:
    """`eqn` (a `scan`) fully unrolled, running `body`, which takes and
    returns one more carry after the others: `first` in, `last` out.
    `body`'s `debug_info` must already name the new carry
    (`with_carry_names`). The carry's flat trees are rebuilt as `scan`
    itself binds them (one leaf per value)."""
    at_in, at_out = scan_carry(eqn)
    consts, carry, xs = eqn.params["ft_in"].unpack()
    _, ys = eqn.params["ft_out"].unpack()
    carry = flattree.nones(len(carry) + 1)
    return eqn.replace(
        invars=[*eqn.invars[:at_in], first, *eqn.invars[at_in:]],
        outvars=[*eqn.outvars[:at_out], last, *eqn.outvars[at_out:]],
        params={
            **eqn.params,
            "jaxpr": ClosedJaxpr(body, scan_body(eqn).consts),
            "ft_in": flattree.pack((consts, carry, xs)),
            "ft_out": flattree.pack((carry, ys)),
            "unroll": max(int(eqn.params["length"]), 1),
        },
    )


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
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


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def new_var(like: Var) -> Var:
    """A fresh variable of `like`'s abstract value."""
    return Var(like.aval)


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def opaque_trace_state() -> Any:
    """An object equal for two calls in the same trace, and only then."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def is_tracer(x: Any) -> bool:
    """Whether `x` is a value being traced (not a concrete array)."""
    return isinstance(x, jax.core.Tracer)


# -- multi-process jobs ------------------------------------------------------------------


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def coordination_client():
    """The client of JAX's coordination service in this process (None before
    `jax.distributed.initialize`): what answers which processes are alive
    and holds barriers. From `jax._src.distributed`, no public equivalent."""
    from jax._src import distributed

    return distributed.global_state.client


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def cached_programs_hang_cpu_jobs() -> bool:
    """Whether this jaxlib hangs a multi-process CPU job whose processes load
    a program from the persistent compilation cache: each process's devices
    wait in the program's first collective for ever. Read from the jaxlib
    version: 0.12.1 does (a 2-process `zpp launch` on 8 CPU devices, run
    twice on one cache directory); 0.11.2 and 0.12.0.1 do not."""
    import jaxlib

    return jaxlib.__version__ == "0.12.1"


# -- axis names -------------------------------------------------------------------------

# Parameters of the collectives (psum, pmax, all_gather, ppermute, all_to_all,
# psum_scatter, axis_index) that name the axes they run over.
_AXIS_PARAMS = ("axes", "axis_name")


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
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


# -- XLA flags ------------------------------------------------------------------------------


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def known_xla_flags(flags: Iterable[str]) -> tuple[list[str], list[str]]:
    """(The flags among `flags`, ``--name=value`` strings, that this jaxlib's
    XLA knows; those it does not.)

    XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend, and
    aborts the process on a flag it does not know, so each answer comes from
    a child process that starts the CPU backend with the flags: all of them
    at once, then, if that fails, one at a time. Costs one child process
    (about a second) when every flag is known, one more per flag otherwise.
    """
    flags = list(flags)
    if not flags or _starts_with(flags):
        return flags, []
    known = [f for f in flags if _starts_with([f])]
    return known, [f for f in flags if f not in known]


def _starts_with(flags: list[str]) -> bool:
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    child = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env=env,
        capture_output=True,
        check=False,
    )
    return child.returncode == 0


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
def known_compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` (``jax.jit(..., compiler_options=...)``) without those this
    jaxlib's XLA lacks, each left out with a warning that names it: a
    compile given an option XLA does not know fails, where the option only
    tunes the schedule. Costs a trivial compile per set of options a
    process asks about, one more per option when one is unknown."""
    if not options or _compiles_with(tuple(options.items())):
        return dict(options)
    known = {k: v for k, v in options.items() if _compiles_with(((k, v),))}
    lacking = sorted(set(options) - set(known))
    warnings.warn(
        f"this jaxlib's XLA lacks the compile options {', '.join(lacking)}; compiling without them",
        stacklevel=2,
    )
    return known


@functools.cache
def _compiles_with(options: tuple[tuple[str, Any], ...]) -> bool:
    lowered = jax.jit(lambda x: x).lower(jax.ShapeDtypeStruct((), "float32"))
    try:
        lowered.compile(dict(options))
    except jax.errors.JaxRuntimeError:
        return False
    return True


@checked_on("0.11.2", "0.12.0.1", "0.12.1")
@contextlib.contextmanager
def sharding_constraints_routed(route: Callable) -> Iterator[None]:
    """A block in which ``jax.lax.with_sharding_constraint(x, shardings)``,
    as code calls it through the `jax.lax` module (Flax's Linen and NNX do,
    and so does a model that writes ``jax.lax.with_sharding_constraint``),
    is ``route(x, shardings, original)``. Code that imported the function
    itself before the block calls JAX's own. Tracing runs on one thread:
    the attribute is JAX's again when the block ends, also on an error."""
    original = jax.lax.with_sharding_constraint

    def routed(x, shardings):
        return route(x, shardings, original)

    jax.lax.with_sharding_constraint = routed
    try:
        yield
    finally:
        jax.lax.with_sharding_constraint = original
