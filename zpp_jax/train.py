"""Training with ZeRO++ from Flax (NNX or Linen) and Optax.

A model enters as `ModelParts`: three pure functions (embedding, one block,
head) and their parameters, the blocks stacked along a leading layer axis.
`nnx_parts` and `linen_parts` build them. `Trainer` shards the parameters
into fp32 primary shards, keeps the optimizer state on those shards, and
compiles one training step:

* inside `jax.shard_map`: embedding, the blocks under `lax.scan` (one
  `ShardedLayer` call per block, so at most about two blocks' full weights are
  alive at once) and the head, each gathered and reduced by the engine;
  gradients accumulate over `grad_accum` micro-batches;
* outside it, on the sharded global arrays: the Optax update (so norms such
  as `optax.clip_by_global_norm` are computed over the whole model, padding
  contributing zeros), and a finiteness check: a step whose gradients or loss
  hold NaN or Inf leaves the state untouched and reports `skipped = 1`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.layer import ShardedLayer, scan_layers
from zpp_jax.mesh import AXES, mesh_shape
from zpp_jax.partition import FlatLayout, shard_params, unshard_params

PyTree = Any
GROUPS = ("embed", "blocks", "head")


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """A model as pure functions: ``head(blocks(embed(tokens)))``.

    embed_fn(params, tokens) -> hidden; block_fn(params, hidden) -> hidden
    (one block; `block_params` stack all blocks along axis 0);
    head_fn(params, hidden) -> logits.
    """

    embed_fn: Callable[[PyTree, jax.Array], jax.Array]
    block_fn: Callable[[PyTree, jax.Array], jax.Array]
    head_fn: Callable[[PyTree, jax.Array], jax.Array]
    embed_params: PyTree
    block_params: PyTree
    head_params: PyTree

    @property
    def fns(self) -> dict[str, Callable]:
        return {"embed": self.embed_fn, "blocks": self.block_fn, "head": self.head_fn}

    @property
    def params(self) -> dict[str, PyTree]:
        return {"embed": self.embed_params, "blocks": self.block_params, "head": self.head_params}


def nnx_parts(model) -> ModelParts:
    """Parts of an NNX model with submodules `embed`, `blocks` (parameters
    stacked along a leading layer axis, e.g. made with `nnx.vmap`) and `head`.

    Only `nnx.Param` state is sharded and trained; other state is kept as it is
    and closed over (constant).
    """
    from flax import nnx

    missing = [name for name in GROUPS if not hasattr(model, name)]
    if missing:
        raise UsageError(
            f"the model lacks submodule(s) {missing}; nnx_parts needs `embed`, `blocks` "
            "(stacked) and `head`, or build ModelParts yourself"
        )
    fns, params = {}, {}
    for name in GROUPS:
        graphdef, p, rest = nnx.split(getattr(model, name), nnx.Param, ...)

        def fn(p, x, graphdef=graphdef, rest=rest):
            return nnx.merge(graphdef, p, rest)(x)

        fns[name], params[name] = fn, p
    return ModelParts(
        fns["embed"],
        fns["blocks"],
        fns["head"],
        params["embed"],
        params["blocks"],
        params["head"],
    )


def linen_parts(embed, block, head, embed_params, block_params, head_params) -> ModelParts:
    """Parts of a Linen model given as three modules and their ``params``
    collections (`block_params` stacked, e.g. ``jax.vmap(block.init)``)."""

    def apply(module):
        return lambda p, x: module.apply({"params": p}, x)

    return ModelParts(
        apply(embed), apply(block), apply(head), embed_params, block_params, head_params
    )


class TrainState(NamedTuple):
    """step: optimizer steps applied (int32); params: {group: fp32 primary
    shards}; opt_state: the Optax state on those shards; residuals: error-feedback
    residuals per group, or None."""

    step: jax.Array
    params: dict[str, jax.Array]
    opt_state: optax.OptState
    residuals: dict[str, jax.Array] | None


def default_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy against ``batch["targets"]``."""
    from zpp_jax.models.gpt import cross_entropy

    return cross_entropy(logits, batch["targets"])


class Trainer:
    """Compiled ZeRO++ training and evaluation steps for one model, optimizer,
    mesh and configuration.

    Memory per device: 4 bytes per parameter / N for the fp32 shards, and the
    optimizer's state on the same shards; with hpZ, per block, a secondary
    shard (1/local of the gathered weight, in the wire format) kept from the
    forward to the backward pass; with error feedback, a residual of
    (1 + 1/local) x the parameter count in `config.residual_dtype` (the
    rounding error of this device's whole local gradient).
    """

    def __init__(
        self,
        parts: ModelParts,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        config: ZeroPPConfig,
        compute_dtype=jnp.bfloat16,
        grad_accum: int = 1,
        loss_fn: Callable[[jax.Array, dict], jax.Array] = default_loss,
    ) -> None:
        if not isinstance(grad_accum, int) or grad_accum <= 0:
            raise UsageError(f"grad_accum must be a positive int, got {grad_accum!r}")
        self.parts, self.optimizer, self.mesh, self.config = parts, optimizer, mesh, config
        self.grad_accum, self.loss_fn = grad_accum, loss_fn
        nodes, local = mesh_shape(mesh)
        self.num_devices = nodes * local
        self.layouts = {
            name: FlatLayout.from_tree(
                p, self.num_devices, stacked=name == "blocks", align=config.alignment
            )
            for name, p in parts.params.items()
        }
        self.layers = {
            name: ShardedLayer(parts.fns[name], self.layouts[name], config, compute_dtype)
            for name in GROUPS
        }
        self.num_layers = jax.tree.leaves(parts.block_params)[0].shape[0]
        self.step = jax.jit(self.train_step, donate_argnums=0)
        self.evaluate = jax.jit(self.eval_step)

    # -- state ---------------------------------------------------------------

    def init(self, params: dict[str, PyTree] | None = None) -> TrainState:
        """Shard `params` (default: the parts' own) and initialize the optimizer
        on the shards."""
        params = self.parts.params if params is None else params
        shards = {
            name: shard_params(
                params[name], self.mesh, stacked=name == "blocks", align=self.config.alignment
            )[0]
            for name in GROUPS
        }
        state = jax.jit(self._state_from_shards)(shards)
        return jax.device_put(state, self.state_shardings(state))

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of `init()`'s state, without computing it."""
        shards = {
            name: jax.ShapeDtypeStruct(
                ((self.num_layers,) if name == "blocks" else ()) + (layout.padded_size,),
                jnp.float32,
            )
            for name, layout in self.layouts.items()
        }
        state = jax.eval_shape(self._state_from_shards, shards)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            state,
            self.state_shardings(state),
        )

    def _state_from_shards(self, shards):
        residuals = None
        if self.config.error_feedback:
            nodes, local = mesh_shape(self.mesh)
            residuals = {
                name: jnp.zeros(
                    ((self.num_layers,) if name == "blocks" else ())
                    + (self.num_devices * self.layers[name].residual_size(nodes, local),),
                    self.config.residual_dtype,
                )
                for name in GROUPS
            }
        return TrainState(jnp.zeros((), jnp.int32), shards, self.optimizer.init(shards), residuals)

    def state_shardings(self, state: TrainState) -> TrainState:
        """Shardings of a state: every array laid out like a group's primary
        shards (parameters, optimizer moments, residuals) is sharded like them,
        everything else (counters, scalars) is replicated."""
        n = self.num_devices

        def sharding(leaf):
            shape = getattr(leaf, "shape", ())
            if len(shape) in (1, 2) and shape[-1] % n == 0 and shape[-1] > 0:
                return NamedSharding(self.mesh, P(*([None] * (len(shape) - 1)), AXES))
            return NamedSharding(self.mesh, P())

        return jax.tree.map(sharding, state)

    def export(self, state: TrainState) -> dict[str, PyTree]:
        """The full parameter pytrees {embed, blocks, head}, gathered."""
        return {
            name: unshard_params(state.params[name], self.layouts[name], stacked=name == "blocks")
            for name in GROUPS
        }

    def batch_sharding(self) -> NamedSharding:
        """Sharding for batch arrays: the leading (batch) axis over all devices."""
        return NamedSharding(self.mesh, P(AXES))

    # -- compiled functions ----------------------------------------------------

    def _forward(self, params, residuals, batch):
        r = residuals or {name: None for name in GROUPS}
        h = self.layers["embed"](params["embed"], batch["inputs"], r["embed"])
        h = scan_layers(self.layers["blocks"], params["blocks"], h, r["blocks"])
        return self.layers["head"](params["head"], h, r["head"])

    def _local_grads(self, params, residuals, batch):
        k = self.grad_accum
        micro = jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), batch)

        def loss(params, residuals, mb):
            return self.loss_fn(self._forward(params, residuals, mb), mb)

        def body(carry, mb):
            grads, residuals, total = carry
            value, (g, residuals) = jax.value_and_grad(loss, argnums=(0, 1))(params, residuals, mb)
            return (jax.tree.map(jnp.add, grads, g), residuals, total + value), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, residuals, total), _ = jax.lax.scan(
            body, (zeros, residuals, jnp.zeros((), jnp.float32)), micro
        )
        grads = jax.tree.map(lambda g: g / k, grads)
        return jax.lax.pmean(total / k, AXES), grads, residuals

    def _specs(self, residuals):
        params = {name: P(None, AXES) if name == "blocks" else P(AXES) for name in GROUPS}
        return params, (None if residuals is None else params)

    def _check_batch(self, batch):
        self.check_batch_size(jax.tree.leaves(batch)[0].shape[0])

    def check_batch_size(self, b: int) -> None:
        """Raise ValueError unless a global batch of `b` splits evenly over
        the devices and the micro-batches."""
        if b % (self.num_devices * self.grad_accum):
            raise UsageError(
                f"global batch {b} must be a multiple of devices x grad_accum = "
                f"{self.num_devices} x {self.grad_accum}"
            )

    def train_step(self, state: TrainState, batch: dict[str, jax.Array]):
        """One training step, not jitted (`Trainer.step` is this under `jax.jit`
        with the state donated): returns (new state, metrics with `loss`,
        `grad_norm` and `skipped`)."""
        self._check_batch(batch)
        pspec, rspec = self._specs(state.residuals)
        grads_fn = jax.shard_map(
            self._local_grads,
            mesh=self.mesh,
            in_specs=(pspec, rspec, P(AXES)),
            out_specs=(P(), pspec, rspec),
            check_vma=False,
        )
        loss, grads, residuals = grads_fn(state.params, state.residuals, batch)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(state.step + 1, params, opt_state, residuals)
        new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, state)
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}
        return new, metrics

    def eval_step(self, state: TrainState, batch: dict[str, jax.Array]) -> jax.Array:
        """Mean loss of a batch, forward only (`Trainer.evaluate` is this jitted)."""
        self._check_batch(batch)
        pspec, rspec = self._specs(state.residuals)

        def local(params, residuals, batch):
            return jax.lax.pmean(self.loss_fn(self._forward(params, residuals, batch), batch), AXES)

        f = jax.shard_map(
            local, mesh=self.mesh, in_specs=(pspec, rspec, P(AXES)), out_specs=P(), check_vma=False
        )
        return f(state.params, state.residuals, batch)
