"""Training a Flax NNX model with ZeRO++ and Optax: the compiled step.

`Trainer(model, optimizer, mesh, config)` shards the model (`zpp.shard`),
puts an `nnx.Optimizer` on its parameters, and compiles

* ``train_step(state, batch) -> (state, metrics)``: the loss and gradients
  of ``loss_fn(model, batch)``, averaged over `grad_accum` micro-batches,
  clipped to `max_grad_norm` if given, then the Optax update. A step whose
  loss or gradients hold NaN or Inf, or whose update would leave a NaN or
  Inf anywhere in the state (parameters, optimizer state), leaves the state
  as it was and reports ``skipped = 1``;
* ``eval_step(state, batch) -> loss``, with the model in eval mode.

The state is functional: ``trainer.init()`` returns the `nnx.State` of the
model and the optimizer, a pytree of sharded arrays (each parameter and
optimizer moment in its own shape) that the step donates and returns and
that `Checkpointer` saves as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError, check_optimizer, check_positive_finite
from zpp_jax.mesh import batch_sharding, mesh_shape, on_mesh
from zpp_jax.overlap import DEFAULT_LINKS, LinkModel, check_links
from zpp_jax.overlap.relay import relay_scope
from zpp_jax.program import batch_rows, compile_for_batch, finish_step
from zpp_jax.shard import Policy, shard
from zpp_jax.sharded import compiler_options, value_and_grad
from zpp_jax.unit import expect_units

LossFn = Callable[[nnx.Module, dict], jax.Array]


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Mean cross-entropy of integer `targets` under `logits`, in fp32;
    with `weights` (one per target), the weighted mean
    ``sum(w * nll) / sum(w)`` (0 when every weight is 0)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if weights is None:
        return jnp.mean(nll)
    weights = weights.astype(jnp.float32)
    total = jnp.sum(weights)
    return jnp.where(total > 0, jnp.sum(weights * nll) / jnp.where(total > 0, total, 1.0), 0.0)


def next_token_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """The default loss: ``cross_entropy(model(batch["inputs"]),
    batch["targets"], batch.get("weights"))``: over the targets a batch of
    fine-tuning examples weights (its completions), else over all of them.
    With ``grad_accum`` micro-batches, a step's loss is the mean of each
    micro-batch's weighted mean."""
    check_token_batch(batch)
    return cross_entropy(model(batch["inputs"]), batch["targets"], batch.get("weights"))


def check_token_batch(batch) -> None:
    """Raise UsageError unless `batch` is what `next_token_loss` reads: a
    dict of integer ``inputs`` and ``targets`` of one (rows, tokens) shape,
    and optionally ``weights`` of that shape. Reads shapes and dtypes only
    (it runs while the step is traced, before any compile)."""
    if not isinstance(batch, Mapping) or not {"inputs", "targets"} <= set(batch):
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise UsageError(
            f"the default loss reads a dict of 'inputs' and 'targets' (the token ids, and the "
            f"ids that follow each), got {got}: rename the keys, or pass loss_fn= for a batch "
            "of your own"
        )
    shapes = {k: jnp.shape(batch[k]) for k in ("inputs", "targets", "weights") if k in batch}
    if len(set(shapes.values())) != 1 or len(shapes["inputs"]) != 2:
        raise UsageError(f"inputs, targets and weights are (rows, tokens), alike: got {shapes}")
    for key in ("inputs", "targets"):
        if not jnp.issubdtype(jnp.result_type(batch[key]), jnp.integer):
            raise UsageError(f"batch[{key!r}] holds token ids, integers: got {batch[key].dtype}")


class Trainer:
    """Compiled training and evaluation steps for one model, optimizer, mesh
    and configuration.

    Memory per device: each parameter's block (1/N) and the optimizer's state
    on it, with hpZ a secondary shard per unit held from its forward to its
    backward pass, with error feedback a residual of (1 + 1/local) x each
    unit's size; during the update, a second copy of the state's blocks (the
    new state, kept apart from the old until the finiteness check).

    `model` is sharded in place (see `zpp.shard`); after `init` the state is
    what counts: the step donates its arrays, and `model(state)` gives a
    module on any state.

    `links` (`zpp.LinkModel`, or None for XLA's own estimate) describes
    the GPU cluster's links to XLA's scheduler when `compile_step`
    compiles for a GPU mesh: each collective costed on the links it
    crosses. It changes the schedule, not the arithmetic.

    A model built abstractly (``nnx.eval_shape``) gives an abstract
    trainer (``trainer.abstract`` is True): its state is shapes, dtypes and
    shardings only, `init` refuses, and `compile_step` compiles the step,
    for example for GPUs described by `zpp_jax.analysis.target_mesh`.

    `max_grad_norm` clips the gradients by their global norm before the
    optimizer sees them, as ``optax.clip_by_global_norm(max_grad_norm)``
    first in the chain would, from the norm the step computes anyway (for
    the skip check and the ``grad_norm`` metric) in one scalar all-reduce.
    Clipping inside `optimizer` gives the same result and computes the norm
    again, reducing one scalar per parameter array across the devices.

    `freeze` (an NNX filter, as `zpp.shard` takes it: ``zpp_jax.lora.FROZEN``
    for a LoRA) names the parameters that train nothing: they are stored
    as ``config.frozen_bits`` codes, get no gradient and no optimizer
    state, and stay bit for bit what they were.

    `batch_axis_name`: the model's own name for the data-parallel devices
    (``nnx.BatchNorm(axis_name="batch")``), and `rules`, the logical axis
    rules of its sharding names (a mesh with a `model` axis: tensor
    parallelism), as `zpp.shard` takes them.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        config: ZeroPPConfig | None = None,
        *,
        loss_fn: LossFn = next_token_loss,
        policy: Policy = None,
        compute_dtype=None,
        grad_accum: int = 1,
        max_grad_norm: float | None = None,
        links: LinkModel | None = DEFAULT_LINKS,
        freeze=None,
        batch_axis_name: str | None = None,
        rules=None,
    ) -> None:
        check_links(links)
        check_optimizer(optimizer)
        if not callable(loss_fn):
            raise UsageError(f"loss_fn must be a function (model, batch) -> loss, got {loss_fn!r}")
        self.links = links
        if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum <= 0:
            raise UsageError(f"grad_accum must be a positive int, got {grad_accum!r}")
        if max_grad_norm is not None:
            check_positive_finite("max_grad_norm", max_grad_norm, "number or None (no clipping)")
        self.max_grad_norm = max_grad_norm
        nodes, local = mesh_shape(mesh)
        self.mesh, self.num_devices = mesh, nodes * local
        self.config = ZeroPPConfig.check(config)
        self.loss_fn, self.grad_accum = loss_fn, grad_accum
        sharded = shard(
            model,
            mesh,
            self.config,
            policy,
            compute_dtype,
            freeze=freeze,
            batch_axis_name=batch_axis_name,
            rules=rules,
        )
        self._param_specs = jax.tree.map(lambda a: a.sharding.spec, nnx.state(sharded, nnx.Param))
        self.abstract = any(
            isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(sharded))
        )
        if self.abstract:
            self._graphdef, self._state = _abstract_state(sharded, optimizer, mesh)
        else:
            self._graphdef, state = nnx.split(
                (sharded, nnx.Optimizer(sharded, optimizer, wrt=nnx.Param))
            )
            # Arrays the optimizer made on one device (step counters, schedule
            # state) go onto the mesh, replicated, so the state lives on it whole.
            self._state = on_mesh(state, mesh)
        self._state_specs = jax.tree.map(lambda a: a.sharding.spec, self._state)
        self.compiler_options = compiler_options(sharded, mesh)
        options = self.compiler_options or None
        self.train_step = jax.jit(self._train_step, donate_argnums=0, compiler_options=options)
        self.eval_step = jax.jit(self._eval_step, compiler_options=options)

    # -- state -----------------------------------------------------------------

    def init(self) -> nnx.State:
        """The state of the sharded model and its optimizer (step 0)."""
        if self.abstract:
            raise UsageError(
                "this Trainer was built on an abstract model (nnx.eval_shape): it has no "
                "values to start from; compile its step with trainer.compile_step(batch), "
                "or build the model itself to train it"
            )
        return self._state

    def abstract_state(self) -> nnx.State:
        """Shapes, dtypes and shardings of the state: a restore target."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self._state
        )

    def compile_step(self, batch: dict, compiler_options: dict | None = None):
        """`train_step` compiled (not run) for a batch of `batch`'s shapes and
        dtypes (arrays or `jax.ShapeDtypeStruct`s), laid out as
        `batch_sharding`: a `jax.stages.Compiled`, whose ``as_text()`` is the
        optimized, scheduled program and ``memory_analysis()`` its memory.
        `compiler_options` replace the engine's own (`zpp.overlap.overlap_options`) for
        this compile. On a GPU mesh the scheduler is given what each
        collective costs on `links` (`zpp.LinkModel`; None: XLA's own
        estimate), which takes a second compile; `train_step` called
        directly is scheduled with XLA's own estimate."""
        return compile_for_batch(self, batch, compiler_options)

    def model(self, state: nnx.State) -> nnx.Module:
        """The sharded model with `state`'s arrays (use it under `jax.jit`,
        or `zpp.unshard` it)."""
        return nnx.merge(self._graphdef, state)[0]

    @staticmethod
    def steps_done(state: nnx.State) -> int:
        """Optimizer updates applied so far (skipped steps do not count)."""
        return int(state[1]["step"].get_value())

    def batch_sharding(self) -> NamedSharding:
        """Sharding for batch arrays: the leading (batch) axis over every device."""
        return batch_sharding(self.mesh)

    def check_batch_size(self, b: int) -> None:
        """Raise UsageError unless a global batch of `b` splits evenly over
        the devices and the micro-batches."""
        if b % (self.num_devices * self.grad_accum):
            raise UsageError(
                f"global batch {b} must be a multiple of devices x grad_accum = "
                f"{self.num_devices} x {self.grad_accum}"
            )

    # -- compiled functions ---------------------------------------------------

    def _train_step(self, state: nnx.State, batch: dict) -> tuple[nnx.State, dict]:
        self.check_batch_size(batch_rows(batch))
        model, optimizer = nnx.merge(self._graphdef, state, copy=True)
        with expect_units("the Trainer's loss_fn"):
            if self.grad_accum == 1:
                loss, grads = value_and_grad(self.loss_fn)(model, batch)
            else:
                loss, grads = self._accumulate(model, batch)
        grad_norm = jnp.sqrt(_squared_norm(grads, self._param_specs, self.mesh))

        def update(grads):
            optimizer.update(model, grads)
            return nnx.state((model, optimizer))

        # The update is checked too (a NaN learning rate, an optimizer
        # overflow): every float array of the new state must be finite on
        # every device, one more scalar all-reduce. A skipped step returns
        # the state it was given, error-feedback residuals included.
        return finish_step(
            state,
            loss,
            grads,
            grad_norm,
            self.max_grad_norm,
            update,
            lambda new: _all_finite(new, self._state_specs, self.mesh),
        )

    def _accumulate(self, model: nnx.Module, batch: dict):
        """Loss and gradients averaged over `grad_accum` micro-batches, each
        spread over every device (row j of a device's rows goes to micro-batch
        j * grad_accum // rows)."""
        k, n = self.grad_accum, self.num_devices

        def split(a):
            a = a.reshape(n, k, a.shape[0] // (n * k), *a.shape[1:])
            return jnp.swapaxes(a, 0, 1).reshape(k, a.shape[0] * a.shape[2], *a.shape[3:])

        micro = jax.tree.map(split, batch)
        graphdef, params, others = nnx.split(model, nnx.Param, ...)

        def body(carry, mb):
            others, total_grads, total_loss = carry
            m = nnx.merge(graphdef, params, others, copy=True)
            loss, grads = value_and_grad(self.loss_fn)(m, mb)
            _, _, others = nnx.split(m, nnx.Param, ...)
            return (others, jax.tree.map(jnp.add, total_grads, grads), total_loss + loss), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (others, grads, loss), _ = jax.lax.scan(
            body, (others, zeros, jnp.zeros((), jnp.float32)), micro
        )
        nnx.update(model, others)
        return loss / k, jax.tree.map(lambda g: g / k, grads)

    def _eval_step(self, state: nnx.State, batch: dict) -> jax.Array:
        self.check_batch_size(batch_rows(batch))
        model, _ = nnx.merge(self._graphdef, state, copy=True)
        model.eval()
        with relay_scope():
            return self.loss_fn(model, batch)


PyTree = Any


def _abstract_state(sharded: nnx.Module, optimizer, mesh: Mesh):
    """The graph definition and the abstract state (shapes, dtypes and
    shardings) of an abstract sharded model and its optimizer, allocating
    nothing. The optimizer's leaves that mirror a parameter (Adam's moments:
    same path below the optimizer state, same shape) get its sharding, as
    ``jnp.zeros_like`` on the stored parameter gives them; every other leaf
    (step counters, unmirrored statistics) is replicated over `mesh`, as
    `on_mesh` places them."""
    replicated = NamedSharding(mesh, P())

    def or_replicated(a):
        if getattr(a, "sharding", None) is not None:
            return a
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)

    graphdef, state = nnx.split(sharded)
    state = jax.tree.map(or_replicated, state)
    made = {}

    def build(state):
        model = nnx.merge(graphdef, state)
        made["graphdef"], out = nnx.split((model, nnx.Optimizer(model, optimizer, wrt=nnx.Param)))
        return out

    out = jax.eval_shape(build, state)
    params = {
        tuple(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(sharded, nnx.Param))
    }
    own = {tuple(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)}

    def placed(path, leaf):
        if tuple(path[1:]) in own:  # the model's own state, as sharded
            return own[tuple(path[1:])]
        for start in range(1, len(path)):
            param = params.get(tuple(path[start:]))
            if param is not None and param.shape == leaf.shape:
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param.sharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated)

    return made["graphdef"], jax.tree_util.tree_map_with_path(placed, out)


def _squared_norm(tree: PyTree, specs: PyTree, mesh: Mesh) -> jax.Array:
    """The squared global 2-norm of `tree`, whose arrays are laid out on
    `mesh` as `specs` says, in fp32. Each device sums the squares of its
    blocks, then one scalar all-reduce adds the devices' sums (where the
    partitioner would reduce one scalar per array)."""
    leaves, spec_leaves = jax.tree.leaves(tree), _spec_leaves(specs)

    def copies(spec: P) -> int:
        """Devices holding each element: the sizes of the axes it is not split over."""
        split = {a for entry in spec if entry is not None for a in np.atleast_1d(entry)}
        return int(np.prod([size for a, size in mesh.shape.items() if a not in split]))

    def local(*blocks):
        total = jnp.zeros((), jnp.float32)
        for block, spec in zip(blocks, spec_leaves, strict=True):
            total += jnp.sum(jnp.square(block.astype(jnp.float32))) / copies(spec)
        return jax.lax.psum(total, mesh.axis_names)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec_leaves), out_specs=P())(*leaves)


def _all_finite(tree: PyTree, specs: PyTree, mesh: Mesh) -> jax.Array:
    """True when every float element of `tree`, whose arrays are laid out on
    `mesh` as `specs` says, is finite. Each device counts the non-finite
    elements of its blocks, then one scalar all-reduce adds the counts
    (where the partitioner would reduce one scalar per array)."""
    pairs = [
        (x, spec)
        for x, spec in zip(jax.tree.leaves(tree), _spec_leaves(specs), strict=True)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]

    def local(*blocks):
        # Blocks of one shape and dtype (a parameter and its optimizer
        # moments) are counted in one reduction over their stack, which XLA
        # fuses without writing it: one pass each instead of one per array.
        groups: dict = {}
        for b in blocks:
            groups.setdefault((b.shape, b.dtype), []).append(b)
        bad = sum(
            jnp.sum(~jnp.isfinite(jnp.stack(group)), dtype=jnp.int32) for group in groups.values()
        )
        return jax.lax.psum(bad, mesh.axis_names) == 0

    in_specs = tuple(spec for _, spec in pairs)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())(*[x for x, _ in pairs])


def _spec_leaves(specs: PyTree) -> list[P]:
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
