"""A vjp that keeps the activations and drops what depends on the weights
alone, so that a sharded unit saves what autodiff needs from its forward
pass without keeping its gathered weights until the backward pass.

`jax.vjp(fn, params, x)` keeps every residual its pullback needs: the
activations, and the weights themselves (a matmul's input gradient needs the
weight) with whatever is computed from them alone (a cast, a transpose, a
reshaped kernel). `split_vjp` traces the same vjp, sorts each residual by
whether it depends on `x`, and keeps only those that do. `pullback` rebuilds
the rest from weights gathered again in the backward pass, by replaying only
the operations that produced them (dead-code elimination of the traced
forward pass), and returns the vjp of the original function.

The dependence is exact through nested jits, scans and `jax.checkpoint`:
each residual is traced back to the inputs it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

# Dead-code elimination of a jaxpr, and its closed-over constants made inputs:
# the two transformations the split needs, from JAX's partial evaluator.
from zpp_jax._compat import convert_constvars_jaxpr, dce_jaxpr


@jax.tree_util.register_pytree_node_class
class Saved:
    """What `split_vjp` keeps for the backward pass: the activations the
    pullback needs and the closed-over values it recomputes from (arrays),
    plus the recipe for the weight-only residuals (static)."""

    def __init__(self, kept: list, consts: list, recipe: tuple) -> None:
        self.kept, self.consts, self.recipe = kept, consts, recipe

    def tree_flatten(self):
        return (self.kept, self.consts), self.recipe

    @classmethod
    def tree_unflatten(cls, recipe, children):
        return cls(*children, recipe)


def split_vjp(fn: Callable[[Any, Any], Any], params: Any, x: Any) -> tuple[Any, Saved]:
    """``fn(params, x)`` and the part of its vjp residuals that depends on `x`.

    Costs one forward pass of `fn` (as `jax.vjp` does). Memory kept: the
    residuals that depend on `x` (activations) and any values `fn` closes over
    that the weight-only residuals are computed from; nothing computed from
    `params` alone.
    """
    flat, in_tree = jax.tree.flatten((params, x))
    n_params = len(jax.tree.leaves(params))
    trees = {}

    def traced(*leaves):
        p, xx = jax.tree.unflatten(in_tree, leaves)
        y, pb = jax.vjp(fn, p, xx)
        y_leaves, trees["y"] = jax.tree.flatten(y)
        residuals, trees["pullback"] = jax.tree.flatten(pb)
        return y_leaves, residuals

    closed = jax.make_jaxpr(traced)(*flat)
    jaxpr, consts = convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)
    n_consts, n_y = len(consts), trees["y"].num_leaves
    n_res = len(jaxpr.outvars) - n_y
    from_x = [False] * (n_consts + n_params) + [True] * (len(flat) - n_params)

    def needs_x(i: int) -> bool:
        used = [False] * (n_y + n_res)
        used[n_y + i] = True
        _, used_inputs = dce_jaxpr(jaxpr, used)
        return any(u and f for u, f in zip(used_inputs, from_x, strict=True))

    weight_only = tuple(not needs_x(i) for i in range(n_res))
    outs = jaxpr_as_fun(ClosedJaxpr(jaxpr, []))(*consts, *flat)
    y = jax.tree.unflatten(trees["y"], outs[:n_y])
    residuals = outs[n_y:]
    kept = [r for r, w in zip(residuals, weight_only, strict=True) if not w]

    replay, used_inputs = dce_jaxpr(jaxpr, [False] * n_y + list(weight_only))
    used_consts = [c for c, u in zip(consts, used_inputs[:n_consts], strict=True) if u]
    used_params = tuple(used_inputs[n_consts : n_consts + n_params])
    recipe = (replay, used_params, weight_only, trees["pullback"])
    return y, Saved(kept, used_consts, recipe)


def pullback(saved: Saved, params: Any) -> Callable:
    """The vjp function of `split_vjp`'s call, its weight-only residuals
    recomputed from `params` (which must equal the forward pass's weights
    for the result to be that call's vjp)."""
    replay, used_params, weight_only, pullback_tree = saved.recipe
    leaves = [p for p, u in zip(jax.tree.leaves(params), used_params, strict=True) if u]
    rebuilt = iter(jaxpr_as_fun(ClosedJaxpr(replay, []))(*saved.consts, *leaves))
    kept = iter(saved.kept)
    residuals = [next(rebuilt) if w else next(kept) for w in weight_only]
    return jax.tree.unflatten(pullback_tree, residuals)
