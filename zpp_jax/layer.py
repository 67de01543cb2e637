"""The sharded layer: one `jax.custom_vjp` around a whole layer function.

Writing ``w = gather(shard); y = f(w, x)`` and letting autodiff do the rest
keeps every layer's full weight alive until the backward pass, and ZeRO-3's
memory saving is lost. `ShardedLayer` instead keeps, per layer, the
activations its backward pass needs (or, with ``remat="full"``, only its
input) and, with hpZ, a secondary shard; the backward pass re-gathers the
weight, rebuilds the layer's vjp with it (recomputing what the policy did not
keep) and reduces the weight gradient straight to the primary shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax import collectives, residuals
from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.mesh import AXES, LOCAL, NODE, mesh_shape
from zpp_jax.overlap import relay
from zpp_jax.partition import Layout, primary_spec
from zpp_jax.tensor import ModelSplit
from zpp_jax.wire import WeightWire

PyTree = Any


class ShardedLayer:
    """A layer ``fn(params, x) -> y`` whose params live as primary shards.

    Call it inside `jax.shard_map` over a (`node`, `local`) mesh as
    ``layer(shard, x)`` or, with error feedback, ``layer(shard, x, residual)``;
    `shard` is this device's (s,) fp32 vector of the layer's parameters as
    `layout` cuts them (`FlatLayout`: a slice of the flat parameters;
    `ParamLayout`: this device's block of every parameter, packed).

    Guarantees:
      * forward: the weights are gathered (qwZ: as int8/int4 codes + fp32
        scales; else in `config.comm_dtype`) and cast to `compute_dtype`
        (default: each leaf's own dtype); `fn` runs once.
      * saved for the backward pass, by `config.remat`: the residuals of
        ``jax.vjp`` that depend on `x` (see `zpp_jax.residuals`), of `fn`
        itself ("none": all activations autodiff keeps) or of
        ``jax.checkpoint(fn, policy=...)`` ("dots": matmul outputs and `x`;
        or the policy given); "full": only `x`.
        With hpZ also a secondary shard (1/local of the gathered weight, in
        the wire format: N*s/local bytes with int8). Nothing of the full
        weight, nor anything computed from the weights alone, is kept.
      * backward: the weight is re-gathered (hpZ: over `local` only, from the
        secondary shards, bit-identical to the forward weight); "none" runs
        the saved vjp with it, "full" recomputes `fn` under `jax.vjp` (one
        more forward pass), a policy recomputes what it did not save. The
        weight gradient (flattened to fp32)
        is reduced over all devices and scattered to this device's shard
        (qgZ: quantized hierarchical all-to-all; else reduce-scatter). The
        cotangent returned for `shard` is that reduced gradient: the mean
        over the data-parallel devices (`reduction="mean"`, for a loss that
        is a mean of per-device losses) or their sum (`"sum"`, for a loss over
        the global batch, whose per-device cotangents are already scaled).
      * error feedback: the cotangent returned for `residual` is the *new*
        residual (a value, not a derivative): read it from ``jax.grad`` with
        respect to the residual and carry it to the next step.
      * ordering, by `prefetch`. False: the forward gather waits for the
        layer's input and the backward re-gather for the layer's cotangent,
        so a backend that runs a program in order (XLA:CPU) never holds more
        than about two layers' full weights. True: the forward gather depends
        on the shard alone and the re-gather on the shard and the saved
        activations, so a latency-hiding scheduler (XLA:GPU, see
        `zpp_jax.overlap.overlap_options`) can start a layer's gather behind the previous
        layer's compute, in either pass; it bounds the weights in flight by
        its memory limit instead. Layers called through `relayed` are
        ordered against their neighbours instead (see there). The math is
        the same either way.
    """

    def __init__(
        self,
        fn: Callable[[PyTree, Any], Any],
        layout: Layout,
        config: ZeroPPConfig,
        compute_dtype=None,
        reduction: str = "mean",
        prefetch: bool = False,
        frozen: WeightWire | None = None,
        model_split: ModelSplit | None = None,
    ) -> None:
        if reduction not in ("mean", "sum"):
            raise UsageError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if not isinstance(prefetch, bool):
            raise UsageError(f"prefetch must be True or False, got {prefetch!r}")
        self.prefetch = prefetch
        self.fn = fn
        self.layout = layout
        self.config = config
        self.compute_dtype = compute_dtype
        self.reduction = reduction
        self._order = relay.LayerOrder(prefetch=prefetch, hpz=config.hpz)
        self._wire = None if layout is None else WeightWire(layout, config, compute_dtype)
        self._frozen = frozen
        self.model_split = model_split
        self._apply = _build(self)
        self._held = _build_held(self)

    @property
    def _shard_shape(self) -> tuple[int]:
        """This device's vector: s, or with tensor parallelism t x s (a
        rank's vector each, along `model`)."""
        degree = 1 if self.model_split is None else self.model_split.degree
        return (degree * self.layout.shard_size,)

    def __call__(self, shard: jax.Array, x: Any, residual: jax.Array | None = None) -> Any:
        if shard.shape != self._shard_shape:
            raise UsageError(
                f"shard has shape {shard.shape}, expected {self._shard_shape}: call the "
                "layer inside jax.shard_map with the spec of zpp_jax.lowlevel.primary_spec()"
            )
        if self.config.error_feedback and residual is None:
            raise UsageError("config.error_feedback is on: pass the layer's residual")
        if not self.config.error_feedback and residual is not None:
            raise UsageError("a residual was passed but config.error_feedback is off")
        if residual is not None and residual.dtype != jnp.dtype(self.config.residual_dtype):
            raise UsageError(
                f"residual has dtype {residual.dtype.name} but config.residual_dtype is "
                f"{self.config.residual_dtype}; create it with ShardedLayer.init_residuals"
            )
        return self._apply(shard, residual, x, None)[0]

    def with_frozen(
        self, shard: jax.Array | None, frozen: jax.Array, x: Any, residual=None, token=None
    ):
        """A call of a layer built with `frozen`: ``fn((params, frozen
        params), x)``, where `frozen` is this device's stored wire of the
        frozen weights (`WeightWire.encode` of their shard, made once).

        Guarantees: the frozen weights travel as they are stored (their
        codes, with hpZ over the node then inside it) both ways, are decoded
        for the computation and never kept across the step; they get no
        gradient and no reduction. `shard` (None when the layer has no
        trainable parameters to split) is gathered and reduced as in
        `__call__`. Returns (the output, the token handed on: None without
        one), as `relayed` does."""
        return self._apply((shard, frozen), residual, x, token)

    def relayed(
        self, shard: jax.Array, x: Any, residual: jax.Array | None, token: jax.Array
    ) -> tuple[Any, jax.Array]:
        """`__call__` that also takes and returns a relay token, which
        orders consecutive layers' communication against each other's
        compute. The token is a (`relay.TOKEN_SIZE`,) float32 array per device
        whose values mean nothing: pass the one the previous layer returned
        (zeros for the first layer) and hand the returned one to the next
        layer.

        Guarantees: the same outputs, gradients and residuals as `__call__`,
        and this order, which a latency-hiding scheduler fills with overlap
        and cannot break:
          * forward: the gather over `local` (without hpZ: the one gather)
            waits for the previous layer's input, so it runs behind the
            previous layer's compute and no earlier; with hpZ the gather
            across nodes waits for the input of the layer before that and
            runs two layers ahead.
          * backward: the re-gather waits for the next layer's backward pass
            to start, so it runs behind that pass and at most two layers'
            full weights are alive (when the next layer's backward pass is
            the step's first, it waits for that layer's forward pass, and
            may also run behind the loss); and the input cotangent leaves
            only once the next layer's gradient reduction has finished, so each
            reduction runs behind the backward pass of the layer before and
            none is left for the end of the step. qgZ's reduction, in two
            steps, is split over two layers: the input cotangent waits for
            the next layer's step inside the node and for the step across
            nodes of the layer after that, so each step runs behind one
            layer's backward pass.
        Costs no bytes and no memory beyond one add over each tied array.
        """
        return self._apply(shard, residual, x, token)

    def held(self, shard: jax.Array, residual: jax.Array | None = None) -> PyTree:
        """The layer's full parameters, gathered once, for a caller that uses
        them several times (a pipeline stage runs its layers in every
        pipeline step).

        Guarantees: the forward pass gathers the weight once, as `__call__`
        does (qwZ codes over the wire; with hpZ hierarchically), and nothing
        else; the backward pass gathers nothing and reduces the sum of the
        cotangents of every use once (qgZ or reduce-scatter, `reduction` as
        in `__call__`), with error feedback returning the new residual as the
        cotangent of `residual`.

        Costs: autodiff keeps the gathered weight (in `compute_dtype`) from
        the forward to the backward pass: what ZeRO saves on weights is given
        up for the span of one training step, in exchange for one gather per
        step instead of one per use.
        """
        if self.config.error_feedback and residual is None:
            raise UsageError("config.error_feedback is on: pass the layer's residual")
        if self.model_split is not None:
            raise UsageError("a held layer (a pipeline stage's) takes no tensor parallelism")
        return self._held(shard, residual)

    def residual_size(self, nodes: int, local: int) -> int:
        """Elements of this layer's error-feedback residual per device."""
        return collectives.residual_size(self.layout.shard_size, nodes, local)

    def init_residuals(self, mesh: Mesh, layers: int | None = None) -> jax.Array:
        """Zero error-feedback residuals, sharded like the primary shards:
        (N * r,) or, for `layers` stacked layers, (layers, N * r), where
        r = `residual_size` elements of `config.residual_dtype` per device."""
        nodes, local = mesh_shape(mesh)
        size = nodes * local * self.residual_size(nodes, local)
        shape = (size,) if layers is None else (layers, size)
        sharding = NamedSharding(mesh, primary_spec(stacked=layers is not None))
        return jnp.zeros(shape, self.config.residual_dtype, device=sharding)

    # -- the pieces the custom_vjp is built from -------------------------------

    def _gather_forward(self, source, token=None):
        """`_gather_rank`, or with tensor parallelism per model rank
        (`ModelSplit.gather`)."""
        if self.model_split is None:
            return self._gather_rank(source, token)
        return self.model_split.gather(
            self._gather_rank, source, self.layout, self.config.hpz, token
        )

    def _gather_rank(self, source, token=None):
        """The full parameters (a pytree) and the hpZ secondary (or None).
        `source`: the primary shard, or with frozen weights (shard or None,
        frozen wire); the parameters are then (params or None, frozen
        params).

        With hpZ the gather is hierarchical: first over `node` (each device
        then holds the shards of its local index on every node: the
        secondary, nodes*s elements on the wire), then over `local`. Across
        nodes a device sends s elements instead of the (N-1)/N of the full
        vector a flat ring carries over each node boundary. `token`: the
        relay token, which the gathers wait on (`LayerOrder`).
        """
        frozen = self._frozen is not None
        shard, stored = source if frozen else (source, None)
        with jax.named_scope("zpp_quantize"):
            wire = None if shard is None else self._wire.encode(shard)
        wire = (wire, stored) if frozen else wire
        with jax.named_scope("zpp_gather"):
            wire = self._order.wire_for_gather(wire, token)
            if not self.config.hpz:
                return self._decode(collectives.gather_all(wire)), None
            secondary = collectives.gather_over(wire, NODE)
            secondary = self._order.secondary_for_gather(secondary, token)
            return self._assemble(secondary), secondary

    def _gather_backward(self, saved):
        if not self.config.hpz:
            return self._gather_forward(saved)[0]
        with jax.named_scope("zpp_gather"):
            if self.model_split is None:
                return self._assemble(saved)
            return self.model_split.assemble(self._assemble, saved, self.layout)

    def _assemble(self, secondary):
        """Secondary (nodes, ...) -> gathered over `local` -> the full weight.

        The gather yields (local, nodes, ...) and the shards are node-major:
        the dequantization reads the rows in that order where they lie
        (`WeightWire.decode`), so the codes are not copied into node-major
        order first.
        """
        return self._decode(collectives.gather_over(secondary, LOCAL), swapped=True)

    @functools.cached_property
    def _frozen_stored_shape(self) -> tuple[int, ...]:
        """The shape of one device's stored frozen wire."""
        size = jax.ShapeDtypeStruct((self._frozen.layout.shard_size,), jnp.float32)
        return jax.eval_shape(self._frozen.encode, size).shape

    def _decode(self, rows, swapped: bool = False):
        """Gathered rows -> the parameters (with frozen weights: the pair);
        `swapped`: rows (local, nodes, ...), as `WeightWire.decode` reads them."""
        if self._frozen is None:
            return self._wire.decode(rows, swapped)
        mine, frozen = rows
        mine = None if mine is None else self._wire.decode(mine, swapped)
        return mine, self._frozen.decode(frozen, swapped)

    def _reduce(self, grads, residual):
        """`_reduce_rank`, and a (1,) marker that exists once the reduction
        has finished; with tensor parallelism per model rank
        (`ModelSplit.reduce`: no residual, and markers each rank reads its
        own of)."""
        if self.model_split is None:
            shard, new_residual, node_step = self._reduce_rank(grads, residual)
            return shard, new_residual, node_step, shard[:1]
        return self.model_split.reduce(lambda g: self._reduce_rank(g, None), grads, self.layout)

    def _reduce_rank(self, grads, residual):
        """The layer's weight gradient (a pytree) -> this device's shard of
        the mean (or sum) over all devices, the new residual (or None), and
        (1,) float32 zeros that exist once qgZ's step inside the node has
        finished (None for a reduction in one step)."""
        cfg, layout, mean = self.config, self.layout, self.reduction == "mean"
        if not cfg.quantize_gradients:
            with jax.named_scope("zpp_reduce"):
                flat = layout.flatten_rows(grads).reshape(-1)
                return collectives.reduce_scatter(flat, cfg.comm_dtype, mean=mean), None, None
        with jax.named_scope("zpp_quantize"):
            if residual is None and layout.align % cfg.grad_block == 0:
                # Every tensor starts on a block boundary, so the blocks of the
                # flat vector are the blocks of each tensor (zero blocks in the
                # gaps): quantizing tensor by tensor gives the same bits without
                # writing and re-reading the whole fp32 gradient.
                flat = layout.quantize_gradient(
                    grads,
                    cfg.gradient_bits,
                    cfg.grad_block,
                    cfg.gradient_rounding,
                    cfg.gradient_scale_dtype,
                )
            else:
                flat = layout.flatten_rows(grads).reshape(-1)
        node_step = []
        with jax.named_scope("zpp_reduce"):
            shard, new_residual = collectives.hierarchical_reduce_scatter(
                flat,
                cfg.gradient_bits,
                cfg.grad_block,
                residual,
                mean=mean,
                rounding=cfg.gradient_rounding,
                scale_dtype=cfg.gradient_scale_dtype,
                before_node_step=lambda q: node_step.append(relay.done_marker(q.scales)),
            )
        return shard, new_residual, (node_step[0] if node_step else None)


# The named recomputation policies ("full" is the layer's own path).
_POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable, "full": None}


def _build(layer: ShardedLayer):
    """The layer's `custom_vjp`: gather -> compute forward; re-gather ->
    vjp -> reduce backward, with `layer._order`'s ties between them."""
    remat, order = layer.config.remat, layer._order
    policy = _POLICIES[remat] if isinstance(remat, str) else remat
    fn = layer.fn if policy is None else jax.checkpoint(layer.fn, policy=policy)

    @jax.custom_vjp
    def apply(shard, residual, x, token):
        params, _ = layer._gather_forward(order.shard_for_gather(shard, x, token), token)
        return layer.fn(params, x), order.handed_on(token, x)

    def fwd(shard, residual, x, token):
        shard, residual, x, token = _values((shard, residual, x, token))
        params, secondary = layer._gather_forward(order.shard_for_gather(shard, x, token), token)
        if remat == "full":
            y, kept = layer.fn(params, x), x
        else:
            y, kept = residuals.split_vjp(fn, params, x)
        saved = secondary if layer.config.hpz else shard
        return (y, order.handed_on(token, x)), (saved, residual, kept)

    def bwd(res, cotangents):
        # Relayed and no later layer asks for anything (the token's
        # cotangent is a symbolic zero): this layer's backward pass is the
        # first, right after the forward pass and the loss.
        first = isinstance(cotangents[1], SymbolicZero)
        g, g_token = _instantiate(cotangents)
        saved, residual, kept = res
        saved, g = order.saved_for_regather(saved, kept, g, g_token)
        params = layer._gather_backward(saved)
        if remat == "full":
            _, vjp = jax.vjp(layer.fn, params, kept)
        else:
            vjp = residuals.pullback(kept, params)
        g_params, g_x = vjp(g)
        if layer._frozen is not None:
            return _frozen_bwd(layer, g_params[0], g_x, residual, g_token, first, kept, g)
        shard_grad, new_residual, node_step, done = layer._reduce(g_params, residual)
        g_x, g_token = order.released(g_x, done, node_step, g_token, first, kept, g)
        return shard_grad, new_residual, g_x, g_token

    apply.defvjp(fwd, bwd, symbolic_zeros=True)
    return apply


def _frozen_bwd(layer: ShardedLayer, g_params, g_x, residual, g_token, first, kept, g):
    """The backward pass's end for a layer with frozen weights: the
    trainable parameters' gradient reduced (if there are any), and no
    cotangent (float0 zeros) for the frozen weights' stored codes."""
    shard_grad = new_residual = node_step = None
    done = jnp.zeros((1,), jnp.float32)
    if layer.layout is not None:
        shard_grad, new_residual, node_step, done = layer._reduce(g_params, residual)
    g_x, g_token = layer._order.released(g_x, done, node_step, g_token, first, kept, g)
    stored = np.zeros(layer._frozen_stored_shape, jax.dtypes.float0)
    return (shard_grad, stored), new_residual, g_x, g_token


def _values(tree):
    """The primal values of `fwd`'s arguments (``symbolic_zeros=True`` wraps them)."""
    return jax.tree.map(
        lambda p: p.value if isinstance(p, CustomVJPPrimal) else p,
        tree,
        is_leaf=lambda p: isinstance(p, CustomVJPPrimal),
    )


def _instantiate(tree):
    """`tree` with its symbolic zeros made arrays of zeros (float0 ones, the
    cotangents of integer outputs, as numpy arrays, which is what JAX takes)."""

    def zeros(z):
        if not isinstance(z, SymbolicZero):
            return z
        if z.dtype == jax.dtypes.float0:
            return np.zeros(z.shape, z.dtype)
        return jnp.zeros(z.shape, z.dtype)

    return jax.tree.map(zeros, tree, is_leaf=lambda z: isinstance(z, SymbolicZero))


def _build_held(layer: ShardedLayer):
    @jax.custom_vjp
    def held(shard, residual):
        return layer._gather_forward(shard)[0]

    def fwd(shard, residual):
        return layer._gather_forward(shard)[0], residual

    def bwd(residual, g):
        return layer._reduce(g, residual)[:2]

    held.defvjp(fwd, bwd)
    return held


def scan_layers(
    layer: ShardedLayer,
    shards: jax.Array,
    x: Any,
    residuals: jax.Array | None = None,
) -> Any:
    """Run a stack of identical layers under `lax.scan`, one sharded-layer call
    per layer: at most about two layers' full weights are alive at once.

    shards: (layers, s) this device's stacked primary shards; residuals:
    (layers, r) with error feedback, else None.
    """

    def body(h, xs):
        shard, residual = xs
        return layer(shard, h, residual), None

    h, _ = lax.scan(body, x, (shards, residuals))
    return h


def stack_value_and_grad(
    layer: ShardedLayer, mesh: Mesh, loss_fn: Callable[..., jax.Array]
) -> Callable:
    """``f(shards, residuals, x, *rest) -> (loss, shard grads, new residuals)``
    for a stack of `layer` under `lax.scan`, wrapped in `jax.shard_map`.

    `x` and `rest` are split over all devices along axis 0;
    ``loss_fn(stack_output, x, *rest)`` is a device's local loss, and `loss`
    its mean over devices. `shards` (and `residuals`, with error feedback, else
    None) are laid out as `primary_spec(stacked=True)`.
    """

    def local(shards, residuals, x, *rest):
        def loss(shards, residuals):
            return loss_fn(scan_layers(layer, shards, x, residuals), x, *rest)

        value, (g, r) = jax.value_and_grad(loss, argnums=(0, 1))(shards, residuals)
        return lax.pmean(value, AXES), g, r

    spec = primary_spec(stacked=True)
    res_spec = spec if layer.config.error_feedback else None

    def f(shards, residuals, x, *rest):
        batch_specs = (P(AXES),) * (1 + len(rest))
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(spec, res_spec, *batch_specs),
            out_specs=(P(), spec, res_spec),
            check_vma=False,
        )(shards, residuals, x, *rest)

    return f
