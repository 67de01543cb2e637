"""Training a decoder LM as a token pipeline: the compiled step, like `Trainer`'s.

`PipelineTrainer(model, optimizer, mesh, slices, config)` lays the model out
for a (`stage`, `node`, `local`) mesh through a `TokenPipeline` and compiles

* ``train_step(state, batch) -> (state, metrics)``: the pipelined loss and
  gradients of the batch, clipped to `max_grad_norm` if given, then the
  Optax update; a step whose loss, gradients or updated state hold a NaN or
  Inf leaves the state as it was and reports ``skipped = 1``;
* ``eval_step(state, batch) -> loss``, the forward schedule alone.

It is a `zpp_jax.program.TrainingProgram`, as `Trainer` is, so `zpp train`
runs either; its step ends as `Trainer`'s does (`finish_step`). The state is
a dict of sharded arrays: ``params`` (the pipeline layout, see
`TokenPipeline.params`), ``opt_state`` (the optimizer's, on the same
layout), ``step`` (updates applied) and, with error feedback,
``residuals``. The math is the unpipelined model's: gradients equal to fp32
round-off, the optimizer applied to the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError, check_optimizer, check_positive_finite
from zpp_jax.pipeline.runtime import TokenPipeline
from zpp_jax.program import compile_for_batch, finish_step

State = dict[str, Any]


class PipelineTrainer:
    """Compiled training and evaluation steps of a decoder (a `GPT`, a
    `Llama`, or a model with a `PipelineDecoder`) trained as a token
    pipeline over the `stage` axis of `mesh`, cut into `slices`.

    `config`: ZeRO inside the stages (each stage's layers sharded over its
    node x local devices, gathered once per step; see `TokenPipeline`), or
    None to replicate them there (plain data parallelism).

    Memory per device: the stage's parameters and optimizer state (with
    `config`, 1/(node x local) of the stage's layers; embedding and head
    replicated), the held weights and activations of a step (see
    `TokenPipeline`), and during the update a second copy of the state.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        slices: Sequence[int],
        config: ZeroPPConfig | None = None,
        *,
        max_grad_norm: float | None = None,
        grad_accum: int = 1,
    ) -> None:
        if grad_accum != 1:
            raise UsageError(
                f"grad_accum={grad_accum!r}: the token pipeline splits each sequence into token "
                "slices, not the batch into micro-batches; use grad_accum=1, or the Trainer"
            )
        if max_grad_norm is not None:
            check_positive_finite("max_grad_norm", max_grad_norm, "number or None (no clipping)")
        check_optimizer(optimizer)
        self.max_grad_norm = max_grad_norm
        self.pipe = TokenPipeline(model, mesh, slices, zero=config)
        self.mesh, self.optimizer = mesh, optimizer
        self.num_devices = self.pipe.dp
        params = self.pipe.params()
        replicated = NamedSharding(mesh, P())
        # Moments take their parameter's layout (`zeros_like` of a sharded
        # array keeps its sharding); counters go onto the mesh, replicated.
        opt_state = jax.tree.map(
            lambda a: a if a.ndim else jax.device_put(a, replicated), optimizer.init(params)
        )
        self._state = {
            "params": params,
            "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
        }
        if self.pipe.error_feedback:
            self._state["residuals"] = self.pipe.init_residuals()
        # The pipeline's steps compile with XLA's defaults; on a GPU its
        # schedule is XLA's own (no link model).
        self.compiler_options: dict = {}
        self.links = None
        self.grad_accum = grad_accum
        self.train_step = jax.jit(self._train_step, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step)

    @property
    def slices(self) -> tuple[int, ...]:
        return self.pipe.slices

    # -- state -----------------------------------------------------------------

    def init(self) -> State:
        """The state at step 0: the model's parameters in the pipeline layout."""
        return self._state

    def abstract_state(self) -> State:
        """Shapes, dtypes and shardings of the state: a restore target."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self._state
        )

    @staticmethod
    def steps_done(state: State) -> int:
        """Optimizer updates applied so far (skipped steps do not count)."""
        return int(state["step"])

    def batch_sharding(self) -> NamedSharding:
        """Rows over the data-parallel devices of a stage, replicated over stages."""
        return self.pipe.batch_sharding()

    def check_batch_size(self, b: int) -> None:
        """Raise UsageError unless a global batch of `b` splits evenly over
        the data-parallel devices of a stage."""
        if b % self.num_devices:
            raise UsageError(
                f"global batch {b} must be a multiple of the {self.num_devices} data-parallel "
                "devices of a stage (node x local)"
            )

    def compile_step(self, batch: dict, compiler_options: dict | None = None):
        """`train_step` compiled (not run) for a batch of `batch`'s shapes
        and dtypes, with `compiler_options` (default: none)."""
        return compile_for_batch(self, batch, compiler_options)

    def unstacked_params(self, state: State) -> dict:
        """The parameters in the model's own layout (`blocks` as (L, ...))."""
        return self.pipe.unstack(state["params"])

    # -- compiled functions ---------------------------------------------------

    def _train_step(self, state: State, batch: dict) -> tuple[State, dict]:
        self.check_batch_size(batch["inputs"].shape[0])
        _check_unweighted(batch)
        params = state["params"]
        residuals = state.get("residuals")
        loss, grads, residuals = self.pipe.value_grad_residuals(
            params, residuals, batch["inputs"], batch["targets"]
        )

        def update(grads):
            updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
            new = {
                "params": optax.apply_updates(params, updates),
                "opt_state": opt_state,
                "step": state["step"] + 1,
            }
            if residuals is not None:
                new["residuals"] = residuals
            return new

        return finish_step(
            state,
            loss,
            grads,
            optax.tree.norm(grads),
            self.max_grad_norm,
            update,
            _all_finite,
        )

    def _eval_step(self, state: State, batch: dict) -> jax.Array:
        self.check_batch_size(batch["inputs"].shape[0])
        _check_unweighted(batch)
        return self.pipe.loss(state["params"], batch["inputs"], batch["targets"])


def _check_unweighted(batch: dict) -> None:
    if "weights" in batch:
        raise UsageError(
            "the token pipeline trains on every token, and this batch weights its targets "
            "(fine-tuning examples): train them without --stages"
        )


def _all_finite(state: State) -> jax.Array:
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats]))
