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
next (`zpp_jax.overlap.relay`, `ShardedLayer.relayed`), which is what lets a
compiler overlap one layer's collectives with its neighbours' compute.
`unroll_relayed_loops` gives a layer loop the same chain without touching
the model's code: it traces the function, and for every loop whose body
starts a relay chain it carries the token through the loop (one more carry,
`zpp_jax.overlap.relay.TOKEN_SIZE` float32 values per device) and unrolls the loop
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

import jax
import jax.extend.core as jcore
from flax import nnx

from zpp_jax import _compat
from zpp_jax.overlap.relay import is_relay_end, is_relay_start


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
    # last relay end, an identity to hand that token on through.
    loop_end = None
    for eqn in jaxpr.eqns:
        if is_relay_end(eqn):
            chain_end, loop_end = eqn.outvars[0], None
        elif is_relay_start(eqn) and loop_end is not None and _continues(chain_end, eqn):
            # The first unit after a rewritten loop takes the loop's last token.
            eqns.append(loop_end.replace(invars=[chain_end], outvars=eqn.outvars))
            chain_end, loop_end, changed = None, None, True
            continue
        if _compat.is_scan(eqn):
            new = _relayed_scan(eqn, chain_end)
            if new is not None:
                rewritten, chain_end, loop_end = new
                eqns.extend(rewritten)
                changed = True
                continue
        inner = _compat.map_inner_jaxprs(eqn, relay_loops)
        changed |= inner is not eqn
        eqns.append(inner)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _continues(token: jcore.Var | None, start: jcore.JaxprEqn) -> bool:
    """Whether `start` (a fresh token) can be replaced by `token`: the same
    mesh's token, so the same shape."""
    fresh = start.outvars[0].aval
    return token is not None and (token.aval.shape, token.aval.dtype) == (fresh.shape, fresh.dtype)


def _relayed_scan(
    eqn: jcore.JaxprEqn, token: jcore.Var | None
) -> tuple[list[jcore.JaxprEqn], jcore.Var, jcore.JaxprEqn] | None:
    """([the loop carrying a token and unrolled, after a fresh token when
    `token` (what the unit before it handed on) cannot start it], the
    loop's last token, the body's last relay end), or None when the loop's
    body starts no relay chain of its own."""
    inner = _compat.scan_body(eqn).jaxpr
    starts = [i for i, e in enumerate(inner.eqns) if is_relay_start(e)]
    ends = [e for e in inner.eqns if is_relay_end(e)]
    if len(starts) != 1 or not ends:
        return None
    start = inner.eqns[starts[0]]
    token_in, token_out = start.outvars[0], ends[-1].invars[0]
    at_in, at_out = _compat.scan_carry(eqn)
    new_body = inner.replace(
        eqns=[e for i, e in enumerate(inner.eqns) if i != starts[0]],
        invars=[*inner.invars[:at_in], token_in, *inner.invars[at_in:]],
        outvars=[*inner.outvars[:at_out], token_out, *inner.outvars[at_out:]],
        debug_info=_compat.with_carry_names(inner, at_in, at_out, "relay"),
    )
    fresh = [] if _continues(token, start) else [start.replace(outvars=[_compat.new_var(token_in)])]
    first = fresh[0].outvars[0] if fresh else token
    last = _compat.new_var(token_out)
    loop = _compat.unrolled_scan_with_carry(eqn, new_body, first, last)
    return [*fresh, loop], last, ends[-1]


def unroll_every_loop(f: Callable) -> Callable:
    """`f` (a function of arrays and pytrees of them) with every ``scan`` in
    it lowered fully unrolled, nested ones and those inside calls and
    `jax.checkpoint` regions included: a program without loops, whose
    every iteration a schedule, and the estimate read from it, sees.

    Guarantees the same values as `f` (the same operations in the same
    order). Costs one more trace per trace of the wrapper; the program,
    and its compile time, grow with the iterations."""

    @functools.wraps(f)
    def wrapper(*args):
        closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
        jaxpr = _unrolled(closed.jaxpr)
        flat = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, closed.consts))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), flat)

    return wrapper


def _unrolled(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    eqns = []
    for eqn in jaxpr.eqns:
        eqn = _compat.map_inner_jaxprs(eqn, _unrolled)
        eqns.append(_compat.fully_unrolled_scan(eqn) if _compat.is_scan(eqn) else eqn)
    return jaxpr.replace(eqns=eqns)
