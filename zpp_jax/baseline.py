"""The baseline a user would otherwise write: plain `jax.jit` with FSDP-style
`NamedSharding`s.

`JitFSDP` trains the unmodified model with no engine code in its step:
every parameter and optimizer-state array is sharded over the data-parallel
devices of the (`node`, `local`) mesh along its largest dimension that they
divide (else replicated), and on a mesh with a `model` axis also along the
dimension its sharding names map to `model` (FSDP with tensor parallelism,
as `zpp.shard` splits it), the batch along its leading axis, and XLA's SPMD partitioner
inserts the collectives (all-gathers of the weights, reduce-scatters of the
gradients) and, on a GPU, schedules them with the same options the engine
uses (`zpp_jax.overlap.overlap_options`: latency-hiding scheduler, pipelined gathers and
reductions in layer loops). It has the interface `step_report` reads, so
`zpp comm` compares it with the engine's methods side by side.

Two forms, as users write them. Left alone (`constrain_activations=False`),
the partitioner propagates the parameters' shardings into the activations
and may pick a tensor-parallel plan: it reshards activations between layers
instead of gathering weights. With `constrain_activations=True` every module
with parameters has its array inputs and outputs constrained to the batch
axes (`jax.lax.with_sharding_constraint`, the leading axis over every
device, the others whole), as MaxText's FSDP rules write it in model code
(`nn.with_logical_constraint` on ``activation_batch``): XLA must then gather
each weight and compute on the local batch, which is what FSDP means.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.errors import UsageError, check_compute_dtype, check_optimizer
from zpp_jax.mesh import AXES, MODEL, batch_sharding, data_size, mesh_shape, model_size
from zpp_jax.metadata import check_model_axis, model_dim
from zpp_jax.overlap import DEFAULT_LINKS, LinkModel, check_links, overlap_options
from zpp_jax.overlap.loops import unroll_every_loop
from zpp_jax.program import compile_for_batch
from zpp_jax.train import LossFn, next_token_loss


def fsdp_sharding(
    mesh: Mesh, shape: tuple[int, ...], model_dim: int | None = None
) -> NamedSharding:
    """FSDP-style sharding of an array of `shape`: its largest dimension that
    the data-parallel devices divide (all of them without a `model` axis),
    split over them (the first such dimension on a tie), and `model_dim`
    (tensor parallelism's) over `model`; whole where none is."""
    dims: list = [None] * len(shape)
    if model_dim is not None:
        dims[model_dim] = MODEL
    n = data_size(mesh)
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if i != model_dim and shape[i] % n == 0:
            dims[i] = AXES
            break
    return NamedSharding(mesh, P(*dims) if any(d is not None for d in dims) else P())


def param_shardings(params, mesh: Mesh, rules) -> Any:
    """`fsdp_sharding` of each of `params` (an `nnx.State`), with a `model`
    axis along the dimension its sharding names map to `model` through
    `rules` (`zpp_jax.metadata.model_dim`), as `zpp.shard` splits it.

    Raises:
      UsageError: a `model` axis that no parameter's names map to, or a
        degree that does not divide a named dimension."""
    flat = list(nnx.to_flat_state(params))
    dims = [model_dim(var, mesh, rules, "/".join(map(str, path))) for path, var in flat]
    check_model_axis(dims, mesh)
    leaves, treedef = jax.tree.flatten(params)
    shapes = [np.shape(var.get_value()) for _, var in flat]
    if shapes != [np.shape(x) for x in leaves]:  # both orders are the paths'
        raise AssertionError("nnx.to_flat_state and jax.tree.flatten disagree on the order")
    return treedef.unflatten(
        [fsdp_sharding(mesh, shape, d) for shape, d in zip(shapes, dims, strict=True)]
    )


def _constrain_to_batch(tree, mesh: Mesh):
    """`tree` with every array of two or more dimensions whose leading one
    the data-parallel devices divide constrained to that axis over them,
    its other dimensions whole (with a `model` axis: left to XLA, which
    splits them as tensor parallelism does); other leaves as they are."""
    rest = P.UNCONSTRAINED if model_size(mesh) > 1 else None

    def one(x):
        if isinstance(x, jax.Array) and x.ndim >= 2 and x.shape[0] % data_size(mesh) == 0:
            spec = P(AXES, *[rest] * (x.ndim - 1))
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        return x

    return jax.tree.map(one, tree)


@functools.cache
def _batch_constrained_class(cls: type, mesh: Mesh) -> type:
    """`cls` whose ``__call__`` constrains its inputs and outputs to the
    batch axes (one subclass per class and mesh, so identical modules keep
    identical graph definitions)."""

    def call(self, *args, **kwargs):
        args, kwargs = _constrain_to_batch((args, kwargs), mesh)
        return _constrain_to_batch(cls.__call__(self, *args, **kwargs), mesh)

    return type(cls.__name__, (cls,), {"__call__": call})


def _constrain_modules(model: nnx.Module, mesh: Mesh) -> None:
    """Route the call of every module of `model` that holds parameters
    through `_constrain_to_batch` (in place)."""
    for _, module in nnx.iter_modules(model):
        if type(module).__call__ is nnx.Module.__call__ or not nnx.state(module, nnx.Param):
            continue
        module.__class__ = _batch_constrained_class(type(module), mesh)


class _PlainProgram:
    """What the baselines' programs share: the state ``(params, opt_state,
    rest, step)``, batches split over every device, a loss of the model
    merged from its parameters (cast to `compute_dtype`, if any), one
    device's update, and a step compiled for a batch's shapes. A subclass
    calls `_set_up`, sets ``_abstract_state`` and jits its step with
    `_jitted_train_step`."""

    def _set_up(self, model, optimizer, mesh, loss_fn, compute_dtype, links) -> tuple:
        """Check and keep what every baseline takes; returns the model's
        (params, other variables). Raises UsageError for a mesh that is not
        (`node`, `local`), bad links or a compute dtype that is not floating."""
        mesh_shape(mesh)
        check_links(links)
        check_optimizer(optimizer)
        check_compute_dtype(compute_dtype)
        self.mesh, self.links, self.compute_dtype = mesh, links, compute_dtype
        self._graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        if not self.abstract:
            self._values = (params, rest)
        self._optimizer, self._loss_fn = optimizer, loss_fn
        self.compiler_options = overlap_options(mesh)
        return params, rest

    def _jitted_train_step(self, shardings: tuple):
        """`_train_step` under `jax.jit`: the state laid out by `shardings`
        (and donated), the batch over every device, the metrics replicated."""
        return jax.jit(
            self._train_step,
            in_shardings=(shardings, batch_sharding(self.mesh)),
            out_shardings=(shardings, NamedSharding(self.mesh, P())),
            donate_argnums=0,
            compiler_options=self.compiler_options or None,
        )

    def _concrete_values(self) -> tuple:
        """The model's (params, other variables); UsageError for an abstract model."""
        if self.abstract:
            raise UsageError(
                f"this {type(self).__name__} was built on an abstract model (nnx.eval_shape): "
                "compile its step with compile_step(batch), or build the model itself to train it"
            )
        return self._values

    def batch_sharding(self) -> NamedSharding:
        """Sharding for batch arrays: the leading (batch) axis over every
        device."""
        return batch_sharding(self.mesh)

    def check_batch_size(self, b: int) -> None:
        """Raise UsageError unless a global batch of `b` splits over the
        data-parallel devices."""
        n = data_size(self.mesh)
        if b % n:
            raise UsageError(f"global batch {b} must be a multiple of the {n} data devices")

    @staticmethod
    def steps_done(state: tuple) -> int:
        """Optimizer updates applied so far."""
        return int(state[3])

    def abstract_state(self) -> tuple:
        """Shapes, dtypes and shardings of the state."""
        return self._abstract_state

    def compile_step(self, batch: dict, compiler_options: dict | None = None):
        """`train_step` compiled (not run) for a batch of `batch`'s shapes and
        dtypes; `compiler_options` replace `compiler_options` for this
        compile, and on a GPU mesh the collectives are costed on `links`
        (as `zpp.Trainer.compile_step`)."""
        return compile_for_batch(self, batch, compiler_options)

    def _loss(self, params, rest, batch: dict) -> jax.Array:
        if self.compute_dtype is not None:
            params = jax.tree.map(functools.partial(_cast, dtype=self.compute_dtype), params)
        return self._loss_fn(nnx.merge(self._graphdef, params, rest), batch)

    def _update(self, params, opt_state, rest, batch: dict) -> tuple:
        """One optimizer step on `batch`: (params, opt_state, loss)."""
        value, grads = jax.value_and_grad(self._loss)(params, rest, batch)
        updates, opt_state = self._optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value


class JitFSDP(_PlainProgram):
    """``model`` trained by ``optimizer`` under plain `jax.jit`, its state
    sharded by `param_shardings` (the optimizer's state of a parameter as
    the parameter; `rules`: the logical axis rules of its sharding names,
    default the ones in scope).

    A `zpp_jax.program.TrainingProgram`. The state is ``(params, opt_state,
    rest, step)``: the model's `nnx.Param`s, the optimizer's state, the
    model's other variables (replicated, not trained) and the updates
    applied. ``train_step(state, batch) -> (state, {"loss": ...})`` takes
    the mean `loss_fn` over the global batch (no clipping and no skip
    check: the step a user of plain `jax.jit` writes); `eval_step` its
    loss alone; with `compute_dtype`, the
    floating parameters are cast to it before the model runs (mixed
    precision: the partitioner then gathers them in that dtype), the
    update applied to the fp32 parameters. `model` may be abstract
    (``nnx.eval_shape``), to compile the step for a compile-only mesh
    (`zpp_jax.analysis.target_mesh`). `constrain_activations`: constrain
    every parameter-holding module's inputs and outputs to the batch axes
    (the module docstring says why); the model passed in is not changed.

    Costs what FSDP costs: each parameter is all-gathered in the forward
    pass and, unless XLA keeps the gathered copy, again in the backward
    pass; its gradient is reduce-scattered; XLA decides what is kept.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        *,
        loss_fn: LossFn = next_token_loss,
        compute_dtype=None,
        links: LinkModel | None = DEFAULT_LINKS,
        constrain_activations: bool = False,
        rules=None,
    ) -> None:
        params, rest = self._set_up(model, optimizer, mesh, loss_fn, compute_dtype, links)
        if constrain_activations:
            copy = nnx.merge(self._graphdef, params, rest)
            _constrain_modules(copy, mesh)
            self._graphdef = nnx.graphdef(copy)
        opt_state = jax.eval_shape(optimizer.init, params)
        rules = rules if rules is not None else nn.get_logical_axis_rules()
        params_sharding = param_shardings(params, mesh, rules)
        replicated = NamedSharding(mesh, P())
        # The optimizer's state of each parameter lies as the parameter does.
        opt_sharding = optax.tree_utils.tree_map_params(
            optimizer,
            lambda _, sharding: sharding,
            opt_state,
            params_sharding,
            transform_non_params=lambda a: fsdp_sharding(mesh, jnp.shape(a)),
        )
        self._shardings = (
            params_sharding,
            opt_sharding,
            jax.tree.map(lambda a: replicated, rest),
            replicated,
        )
        self._abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype, sharding=s),
            (params, opt_state, rest, jax.ShapeDtypeStruct((), jnp.int32)),
            self._shardings,
        )
        self.train_step = self._jitted_train_step(self._shardings)
        self.eval_step = jax.jit(
            self._eval_step,
            in_shardings=(self._shardings, batch_sharding(mesh)),
            out_shardings=NamedSharding(mesh, P()),
            compiler_options=self.compiler_options or None,
        )

    def init(self) -> tuple:
        """The sharded state at step 0 (a concrete model only)."""
        params, rest = self._concrete_values()
        params_sh, opt_sh, rest_sh, step_sh = self._shardings
        params = jax.device_put(params, params_sh)
        opt_state = jax.jit(self._optimizer.init, out_shardings=opt_sh)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), step_sh)
        return params, opt_state, jax.device_put(rest, rest_sh), step

    def _train_step(self, state: tuple, batch: dict) -> tuple[tuple, dict[str, Any]]:
        params, opt_state, rest, step = state
        params, opt_state, value = self._update(params, opt_state, rest, batch)
        return (params, opt_state, rest, step + 1), {"loss": value}

    def _eval_step(self, state: tuple, batch: dict) -> jax.Array:
        params, _, rest, _ = state
        return self._loss(params, rest, batch)


def _stacked(tree, n: int, sharding: NamedSharding):
    """Shape/dtype structs of `tree`'s arrays with a leading axis of `n`,
    laid out by `sharding`."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((n, *jnp.shape(a)), a.dtype, sharding=sharding), tree
    )


class NoCommunication(_PlainProgram):
    """The limit a sharded step is measured against: ``model`` trained by
    ``optimizer`` with nothing exchanged. Every device trains a replica of
    its own on its own rows of the batch, so that each runs one device's
    program: the forward and backward pass over its rows, and the
    optimizer's update of the whole model.

    A `zpp_jax.program.TrainingProgram`. The state is ``(params, opt_state,
    rest, step)`` as `JitFSDP`'s, but each parameter and optimizer-state
    array has a leading axis of one replica per device, split over the
    devices (the model's other variables and the step are replicated).
    ``train_step`` returns the mean of the replicas' losses, gathered:
    the step's one collective, 4 bytes from each device (XLA:GPU's
    scheduler, whose cost model gives the estimate, schedules only a
    program with an asynchronous collective). `compute_dtype` and an
    abstract `model` as for `JitFSDP`. The model's layer loops are unrolled
    (`zpp_jax.overlap.loops.unroll_every_loop`), as the engine unrolls
    its sharded ones, so that XLA's estimate counts every layer. Replicas
    stay equal only when their rows are; `zpp comm` compiles it to measure
    the sharded steps against, nothing more.

    Costs the whole model's parameters and optimizer state on every
    device, and one whole-model update per device and step.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        *,
        loss_fn: LossFn = next_token_loss,
        compute_dtype=None,
        links: LinkModel | None = DEFAULT_LINKS,
    ) -> None:
        params, rest = self._set_up(model, optimizer, mesh, loss_fn, compute_dtype, links)
        per_device = NamedSharding(mesh, P(AXES))
        replicated = NamedSharding(mesh, P())
        opt_state = jax.eval_shape(optimizer.init, params)
        self._abstract_state = (
            _stacked(params, mesh.size, per_device),
            _stacked(opt_state, mesh.size, per_device),
            jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype, sharding=replicated), rest
            ),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        )
        self.train_step = self._jitted_train_step(
            jax.tree.map(lambda a: a.sharding, self._abstract_state)
        )
        self.eval_step = jax.jit(self._eval_step, compiler_options=self.compiler_options or None)

    def init(self) -> tuple:
        """The state at step 0: every replica the model as built (a
        concrete model only)."""
        params, rest = self._concrete_values()
        params_sh, opt_sh, rest_sh, step_sh = jax.tree.map(
            lambda a: a.sharding, self._abstract_state
        )
        n = self.mesh.size
        stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), params)
        params = jax.device_put(stacked, params_sh)
        opt_state = jax.jit(jax.vmap(self._optimizer.init), out_shardings=opt_sh)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), step_sh)
        return params, opt_state, jax.device_put(rest, rest_sh), step

    def _train_step(self, state: tuple, batch: dict) -> tuple[tuple, dict[str, Any]]:
        params, opt_state, rest, step = state

        def replica(params, opt_state, rest, batch):
            params, opt_state = jax.tree.map(lambda x: x[0], (params, opt_state))
            params, opt_state, value = unroll_every_loop(self._update)(
                params, opt_state, rest, batch
            )
            mean = jnp.mean(jax.lax.all_gather(value, AXES))
            return jax.tree.map(lambda x: x[None], (params, opt_state)), mean

        # An all-gather, not a psum: XLA:GPU schedules (and so estimates) a
        # program with an asynchronous all-gather, not one with an all-reduce
        # alone. The mean of the gathered losses is the same on every device,
        # which the varying-axes check cannot see through an all-gather.
        each, whole = P(AXES), P()
        (params, opt_state), loss = jax.shard_map(
            replica,
            mesh=self.mesh,
            in_specs=(each, each, whole, each),
            out_specs=(each, whole),
            check_vma=False,
        )(params, opt_state, rest, batch)
        return (params, opt_state, rest, step + 1), {"loss": loss}

    def _eval_step(self, state: tuple, batch: dict) -> jax.Array:
        """The mean of the replicas' losses on their rows."""
        params, _, rest, _ = state

        def replica(params, rest, batch):
            value = self._loss(jax.tree.map(lambda x: x[0], params), rest, batch)
            return jnp.mean(jax.lax.all_gather(value, AXES))

        each, whole = P(AXES), P()
        return jax.shard_map(
            replica, mesh=self.mesh, in_specs=(each, whole, each), out_specs=whole, check_vma=False
        )(params, rest, batch)


def _cast(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
