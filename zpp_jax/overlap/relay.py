"""The relay: how consecutive units order their collectives against each
other's compute, without changing a value.

A relay token is a (`TOKEN_SIZE`,) float32 array of zeros per device that
exists once some work has finished. Forward, from each unit to the next:
[0] this unit's input, [1] the previous unit's input. Backward (its
cotangent), from each unit to the one before: [0] the backward pass has
started; [1] what the receiving unit's input cotangent must wait for; [2]
what the receiving unit passes on in its own [1] (qgZ's step across nodes,
a unit later).

`LayerOrder` holds every tie one `ShardedLayer` makes, as hooks its
forward and backward passes call between gather, compute, re-gather, vjp
and reduce. `relay_scope` holds the chain of the current trace: the token
the last unit called handed on, which the next unit takes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from zpp_jax import _compat

TOKEN_SIZE = 3
ZERO = np.zeros((1,), np.float32)


def after(tree, *deps, apart: bool = False):
    """`tree` made to depend on the first element of every float array in
    `deps`: a data dependency that no compiler pass can remove (an
    optimization barrier is dropped before XLA:GPU schedules, and XLA:CPU
    drops barriers before its last CSE pass) or see through, so a
    collective on `tree` can neither be hoisted before `deps` exist nor
    merged with an identical one elsewhere. The values are unchanged,
    infinities and NaNs in `deps` included: each element is made finite
    before it is multiplied by 0. Costs one add over each numeric array of
    `tree` (integer codes and raw bits included), and `apart` one kernel
    per element.

    `apart`: each element is read by a kernel of its own, behind a barrier.
    Otherwise XLA:GPU merges ties that read the same arrays (neighbouring
    layers' tokens, a layer's saved activations) with each other or with
    other work into one multi-output fusion, and each tie then waits for
    what all of them wait for: a layer's input cotangent for its own
    gradient reduction, say, which the relay runs behind the next layer's
    compute. The ties that order a unit's collectives against its
    neighbours' work use it."""
    firsts = [_first(x).astype(jnp.float32) for x in floats(deps)]
    if not firsts:
        return tree
    if apart:
        firsts = [lax.optimization_barrier(x) for x in firsts]
    zero = sum(jnp.nan_to_num(x) * 0 for x in firsts)

    def tie(x):
        return x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.number) else x

    return jax.tree.map(tie, tree)


def _first(x: jax.Array) -> jax.Array:
    """`x`'s first element, sliced in place: flattening an array that XLA
    splits along an axis it partitions (`model`, under tensor parallelism)
    would first gather all of it onto every device."""
    return lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(())


def floats(tree) -> list:
    """The non-empty float arrays of `tree`."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating) and x.size]


def done_marker(tree) -> jax.Array:
    """(1,) float32 zeros that exist once `tree` does."""
    return after(ZERO, tree)


@dataclasses.dataclass(frozen=True)
class LayerOrder:
    """The ties of one sharded layer, by how it is ordered:

    * relayed (a token is passed): against its neighbours, through the
      token (see `ShardedLayer.relayed` for the order it guarantees);
    * `prefetch` alone: its gathers wait for nothing but the shard (and,
      backward, the saved activations), for a latency-hiding scheduler;
    * neither: its gathers wait for its input, and its re-gather for its
      cotangent, so that an in-order backend (XLA:CPU) holds no more than
      about two layers' full weights.

    `hpz`: the forward gather is hierarchical (across nodes, then inside
    the node), and the relay runs its two steps one unit apart."""

    prefetch: bool
    hpz: bool

    def shard_for_gather(self, shard, x, token):
        """The shard the forward gather starts from (tied to the layer's
        input unless relayed or prefetching)."""
        if token is not None or self.prefetch:
            return shard
        return after(shard, x)

    def wire_for_gather(self, wire, token):
        """Relayed: the gather across nodes runs two units ahead, the local
        one (or the flat one, without hpZ) one unit ahead."""
        if token is None:
            return wire
        return after(wire, token[1:2] if self.hpz else token[:1], apart=True)

    def secondary_for_gather(self, secondary, token):
        """Relayed, with hpZ: the gather inside the node waits for the
        previous unit's input."""
        return secondary if token is None else after(secondary, token[:1], apart=True)

    def handed_on(self, token, x):
        """The token a unit hands on in the forward pass (None when not
        relayed)."""
        if token is None:
            return None
        return jnp.concatenate([done_marker(x), token[:1], ZERO])

    def saved_for_regather(self, saved, kept, g, g_token):
        """(The saved shard the backward re-gather starts from, the
        cotangent). The re-gather must not be merged with the forward
        gather (the full weight would stay alive in between). Tied to the
        cotangent, it waits for the later layer's backward pass; relayed,
        it waits for the later layer's backward pass to *start* and runs
        behind it; tied to the saved activations (prefetch), it may run
        behind it. The barrier keeps XLA from fusing the re-gather's input
        with the forward gather's, which would make the forward gather wait
        for what the re-gather is tied to."""
        if g_token is not None:
            return after(lax.optimization_barrier(saved), kept, g_token[:1], apart=True), g
        if self.prefetch:
            return after(lax.optimization_barrier(saved), kept if floats(kept) else g), g
        saved, g = lax.optimization_barrier((saved, g))
        return after(saved, g), g

    def released(self, g_x, reduced, node_step, g_token, first: bool, kept, g):
        """(The input cotangent, the token's cotangent) a relayed layer
        returns once its gradient is reduced; `g_x` as it is otherwise.
        `reduced`: an array that exists once the reduction has finished (its
        first element is read).

        The input cotangent leaves only once what the later layer asked for
        has finished (`g_token[1]`), so that work ran behind this layer's
        backward compute and none piles up at the end of the step. A
        reduction in one step asks for all of it. qgZ asks for its step
        inside the node (`node_step`) here and hands its step across nodes
        on (`[2]`) to the layer after: each step then has a layer's backward
        compute to run behind, where both steps in one layer's window left
        the scheduler room for only one. (Also tying the cotangent to this
        layer's own weight gradient, so that its reduction could start
        earlier, cost memory with error feedback and overlap without it.)

        [0] lets the layer before re-gather its weights once this layer's
        cotangent `g` has arrived, or, for the `first` layer of the backward
        pass, once its own saved activations `kept` exist, so that the
        re-gather can run behind the loss and this layer's backward pass. That also
        puts the re-gather and the compute after it where the scheduler,
        which orders by the collective latency above each instruction, runs
        this layer's reduction behind them."""
        if g_token is None:
            return g_x, None
        g_x = after(g_x, g_token[1:2], apart=True)
        done = after(reduced[:1], g_token[2:3], apart=True)
        if node_step is None:
            wait, hand_on = done, ZERO
        else:
            wait, hand_on = after(node_step, g_token[2:3], apart=True), done
        started = done_marker(kept if first and floats(kept) else g)
        return g_x, jnp.concatenate([started, wait, hand_on])


# -- the markers of a chain, which `zpp_jax.overlap.loops` finds in a jaxpr -----------

_RELAY_START = _compat.source_primitive(
    "zpp_relay_start", lambda *, size: jnp.zeros((size,), jnp.float32)
)
_RELAY_END = _compat.identity_primitive("zpp_relay_end")


def relay_start(size: int) -> jax.Array:
    """A fresh relay token of `size` float32 zeros: the first unit called in
    a trace takes it."""
    return _RELAY_START.bind(size=size)


def relay_end(token: jax.Array) -> jax.Array:
    """`token`, marked as the one the last unit called in a trace handed on
    (compiled away)."""
    return _RELAY_END.bind(token)


def is_relay_start(eqn) -> bool:
    """Whether a jaxpr equation is a `relay_start`."""
    return eqn.primitive is _RELAY_START


def is_relay_end(eqn) -> bool:
    """Whether a jaxpr equation is a `relay_end`."""
    return eqn.primitive is _RELAY_END


# -- the chain of the current trace ----------------------------------------------------


class RelayChains:
    """The relay token of the last unit called in the current trace, per
    mesh: consecutive units of an unrolled model are linked through it. A
    unit called in another trace (a scan body, a remat region) starts a
    chain of its own (`zpp_jax.overlap.loops` links a layer loop's chains
    across its iterations, and to the units called before and after the
    loop)."""

    def __init__(self) -> None:
        self._last: dict[Mesh, tuple[Any, jax.Array]] = {}

    def take(self, mesh: Mesh, devices: int) -> jax.Array:
        """The token the last unit called on `mesh` in this trace handed
        on, or a fresh one for `devices` devices (a unit's data-parallel
        devices: its model ranks share theirs)."""
        entry = self._last.pop(mesh, None)
        if entry is not None and entry[0] == _trace():
            return entry[1]
        return relay_start(TOKEN_SIZE * devices)

    def put(self, mesh: Mesh, token: jax.Array) -> None:
        """Hand `token` (what a unit returned) to the next unit."""
        self._last[mesh] = (_trace(), relay_end(token))


def _trace():
    return _compat.opaque_trace_state()


_CHAINS: contextvars.ContextVar[RelayChains | None] = contextvars.ContextVar(
    "zpp_relay_chains", default=None
)


@contextlib.contextmanager
def relay_scope() -> Iterator[RelayChains]:
    """Units called inside the block relay their collectives to each other
    (on a mesh whose units prefetch, a GPU's). The engine opens one around
    every differentiation it runs (`zpp.value_and_grad`, the `Trainer`'s
    steps, `ShardedLinen.apply`); nested blocks share the outer one's
    chains. The tokens are dropped when the outermost block ends."""
    open_chains = _CHAINS.get()
    if open_chains is not None:
        yield open_chains
        return
    chains = RelayChains()
    reset = _CHAINS.set(chains)
    try:
        yield chains
    finally:
        _CHAINS.reset(reset)


def current_chains() -> RelayChains | None:
    """The chains of the innermost `relay_scope`, or None outside one (a
    unit called there is not relayed)."""
    return _CHAINS.get()
