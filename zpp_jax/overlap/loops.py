"""Layer loops that the engine unrolls, so that their units are relayed.

A model that runs a stack of layers with ``nnx.scan`` (or ``jax.lax.scan``)
calls its sharded unit in a loop body traced once. Every iteration then
gathers, computes and reduces one layer by itself: each matrix multiply of
the body either feeds the layer's gradient reduction or needs its gathered
weights, so no schedule of the loop can run one layer's reduction behind
another layer's compute. XLA's collective pipeliner moves a loop's
all-gathers and reduce-scatters by one iteration, but neither all-to-alls
nor collective-permutes (qgZ, and ZeRO-3 on a narrow wire).

The units of an unrolled model hand a relay token from each call to the
next (`zpp_jax.unit`, `ShardedLayer.relayed`), which is what lets a
compiler overlap one layer's collectives with its neighbours' compute.
`unroll_relayed_loops` gives a layer loop the same chain without touching
the model's code: it traces the function, and for every loop whose body
starts a relay chain it carries the token through the loop (one more carry,
`zpp_jax.layer.TOKEN_SIZE` float32 values per device) and unrolls the loop
fully. The loop also joins the chain of the units called around it (a
model's embedding before it, its head after it), which the loop body's own
trace would otherwise cut into three. The arithmetic is the loop's own,
operation for operation; the program grows with the number of iterations,
and so does its compile time.

Recognized: loops whose body calls the units itself, at its top level (not
inside a `jax.checkpoint` or another loop of the body), anywhere in the
function, inside `jax.jit` and `jax.checkpoint` regions included. Other
loops are left as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from flax import nnx


@functools.partial(jax.jit, static_argnums=0)
def zpp_relay_start(size: int) -> jax.Array:
    """A fresh relay token: the first unit called in a trace takes it."""
    return jnp.zeros((size,), jnp.float32)


@jax.jit
def zpp_relay_end(token: jax.Array) -> jax.Array:
    """Marks the token the last unit called in a trace handed on (the
    identity; compiled away)."""
    return token


_START, _END = zpp_relay_start.__name__, zpp_relay_end.__name__
# Primitives whose jaxprs are searched for loops too: calls of a jaxpr as
# it is, and the bodies of loops that are not rewritten.
_SEARCHED = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "scan")


def unroll_relayed_loops(f: Callable) -> Callable:
    """`f` (a function of NNX modules, arrays and pytrees of them) with
    every layer loop whose body calls a relayed unit unrolled, the relay
    token carried from each iteration's units to the next's.

    Guarantees the same values as `f` (the same operations in the same
    order) and the same updates to the modules' state. Costs one more trace
    of `f` per trace of the wrapper; no device memory or communication.
    """

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        graphdef, state = nnx.split((args, kwargs))
        leaves, treedef = jax.tree.flatten(state)
        out_tree: list = []

        def pure(*values):
            a, k = nnx.merge(graphdef, jax.tree.unflatten(treedef, values))
            out = f(*a, **k)
            flat, tree = jax.tree.flatten((out, nnx.split((a, k))[1]))
            out_tree.append(tree)
            return flat

        closed = jax.make_jaxpr(pure)(*leaves)
        jaxpr = relay_loops(closed.jaxpr)
        flat = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, closed.consts))(*leaves)
        out, new_state = jax.tree.unflatten(out_tree[-1], flat)
        nnx.update((args, kwargs), new_state)
        return out

    return wrapper


def relay_loops(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """`jaxpr` with each relay-starting loop rewritten (see the module
    docstring); the same object when there is none.

    The rewritten loop joins the chain of the units called next to it at
    the same level: it takes the token the unit before it handed on, and
    the first unit after it takes the loop's last token in place of a fresh
    one. A model's embedding, its layer loop and its head are then one
    chain, so the head's gradient reduction runs behind the last layer's
    backward compute as every layer's runs behind the next one's."""
    eqns, changed = [], False
    chain_end = None  # the token the last unit called at this level handed on
    # While `chain_end` is a rewritten loop's last token: the loop body's
    # `zpp_relay_end` call, an identity to hand that token on through.
    loop_end = None
    for eqn in jaxpr.eqns:
        marker = _marker(eqn)
        if marker == _END:
            chain_end, loop_end = eqn.outvars[0], None
        elif marker == _START and loop_end is not None and _continues(chain_end, eqn):
            # The first unit after a rewritten loop takes the loop's last token.
            eqns.append(loop_end.replace(invars=[chain_end], outvars=eqn.outvars))
            chain_end, loop_end, changed = None, None, True
            continue
        if eqn.primitive.name == "scan":
            new = _relayed_scan(eqn, chain_end)
            if new is not None:
                rewritten, chain_end, loop_end = new
                eqns.extend(rewritten)
                changed = True
                continue
        if eqn.primitive.name in _SEARCHED:
            params = {k: _inner(v) for k, v in eqn.params.items()}
            if any(params[k] is not v for k, v in eqn.params.items()):
                eqn = eqn.replace(params=params)
                changed = True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _continues(token: jcore.Var | None, start: jcore.JaxprEqn) -> bool:
    """Whether `start` (a fresh token) can be replaced by `token`: the same
    mesh's token, so the same shape."""
    fresh = start.outvars[0].aval
    return token is not None and (token.aval.shape, token.aval.dtype) == (fresh.shape, fresh.dtype)


def _inner(value: Any) -> Any:
    if isinstance(value, jcore.ClosedJaxpr):
        inner = relay_loops(value.jaxpr)
        return value if inner is value.jaxpr else jcore.ClosedJaxpr(inner, value.consts)
    if isinstance(value, jcore.Jaxpr):
        return relay_loops(value)
    return value


def _marker(eqn: jcore.JaxprEqn) -> str | None:
    return eqn.params.get("name") if eqn.primitive.name in ("jit", "pjit") else None


def _relayed_scan(
    eqn: jcore.JaxprEqn, token: jcore.Var | None
) -> tuple[list[jcore.JaxprEqn], jcore.Var, jcore.JaxprEqn] | None:
    """([the loop carrying a token and unrolled, after a fresh token when
    `token` (what the unit before it handed on) cannot start it], the
    loop's last token, the body's last `zpp_relay_end` call), or None when
    the loop's body starts no relay chain of its own."""
    body: jcore.ClosedJaxpr = eqn.params["jaxpr"]
    inner = body.jaxpr
    starts = [i for i, e in enumerate(inner.eqns) if _marker(e) == _START]
    ends = [e for e in inner.eqns if _marker(e) == _END]
    if len(starts) != 1 or not ends:
        return None
    start = inner.eqns[starts[0]]
    token_in, token_out = start.outvars[0], ends[-1].invars[0]
    at_in = eqn.params["num_consts"] + eqn.params["num_carry"]
    at_out = eqn.params["num_carry"]
    info = inner.debug_info
    if info is not None:
        names, paths = info.arg_names, info.result_paths
        info = info._replace(
            arg_names=None if names is None else (*names[:at_in], "relay", *names[at_in:]),
            result_paths=(
                (*paths[:at_out], "relay", *paths[at_out:]) if isinstance(paths, tuple) else paths
            ),
        )
    new_body = inner.replace(
        eqns=[e for i, e in enumerate(inner.eqns) if i != starts[0]],
        invars=[*inner.invars[:at_in], token_in, *inner.invars[at_in:]],
        outvars=[*inner.outvars[:at_out], token_out, *inner.outvars[at_out:]],
        debug_info=info,
    )
    fresh = [] if _continues(token, start) else [start.replace(outvars=[jcore.Var(token_in.aval)])]
    first = fresh[0].outvars[0] if fresh else token
    last = jcore.Var(token_out.aval)
    loop = eqn.replace(
        invars=[*eqn.invars[:at_in], first, *eqn.invars[at_in:]],
        outvars=[*eqn.outvars[:at_out], last, *eqn.outvars[at_out:]],
        params={
            **eqn.params,
            "jaxpr": jcore.ClosedJaxpr(new_body, body.consts),
            "num_carry": eqn.params["num_carry"] + 1,
            "unroll": max(int(eqn.params["length"]), 1),
        },
    )
    return [*fresh, loop], last, ends[-1]
