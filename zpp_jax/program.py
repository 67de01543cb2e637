"""The training-program contract, and the step finish every trainer shares.

`TrainingProgram` is what `zpp_jax.Trainer` (ZeRO++), the token pipeline's
`zpp_jax.pipeline.PipelineTrainer` and the plain-jit baseline
`zpp_jax.baseline.JitFSDP` all offer, so that a loop, a checkpointer or a report
takes any of them: the state at step 0 and its abstract shape, the batch
sharding, the compiled train and eval steps, a compile without running,
and the steps done.

`finish_step` is the end of a training step that the ZeRO++ trainers share:
clipping by the global norm, the optimizer's update, the skip check (a
step whose loss, gradient norm or new state is not finite leaves the state
as it was) and the metrics. `compile_for_batch` compiles a program's step
for a batch's shapes without running it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from zpp_jax.errors import UsageError
from zpp_jax.mesh import devices_per_node
from zpp_jax.overlap.links import compile_with_links

PyTree = Any


@runtime_checkable
class TrainingProgram(Protocol):
    """A model, an optimizer and a mesh, as compiled training steps.

    train_step: ``(state, batch) -> (state, metrics)``, jitted; the state
      is donated. `metrics` holds ``loss`` (and, for the ZeRO++ trainers,
      ``grad_norm`` and ``skipped``).
    eval_step: ``(state, batch) -> loss``, jitted.
    compiler_options: the XLA options the steps compile with.
    """

    mesh: Mesh
    compiler_options: dict
    train_step: Callable[[PyTree, dict], tuple[PyTree, dict]]
    eval_step: Callable[[PyTree, dict], jax.Array]

    def init(self) -> PyTree:
        """The state at step 0."""

    def abstract_state(self) -> PyTree:
        """Shapes, dtypes and shardings of the state: a restore target."""

    def batch_sharding(self) -> NamedSharding:
        """How a global batch's arrays are laid out on the mesh."""

    def check_batch_size(self, b: int) -> None:
        """Raise UsageError unless a global batch of `b` rows splits evenly."""

    def compile_step(self, batch: dict, compiler_options: dict | None = None):
        """`train_step` compiled, not run, for `batch`'s shapes and dtypes."""

    def steps_done(self, state: PyTree) -> int:
        """Optimizer updates applied so far."""


def finish_step(
    state: PyTree,
    loss: jax.Array,
    grads: PyTree,
    grad_norm: jax.Array,
    max_grad_norm: float | None,
    update: Callable[[PyTree], PyTree],
    all_finite: Callable[[PyTree], jax.Array],
) -> tuple[PyTree, dict]:
    """The end of a training step: `grads` clipped to `max_grad_norm` (if
    given) by their global norm `grad_norm`, ``update(grads)`` (the new
    state), and the step kept only if the loss, the norm and, by
    ``all_finite(new state)``, every float of the new state are finite;
    otherwise `state` is returned as it was. Returns (the state, metrics
    ``loss``, ``grad_norm``, ``skipped``).

    Costs: the old state stays alive for the select, so the update's outputs
    take new buffers (the state's size, after the backward pass has freed
    its activations)."""
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if max_grad_norm is not None:
        grads = clip_to_norm(grads, grad_norm, max_grad_norm)
    new = update(grads)
    ok &= all_finite(new)
    new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
    return new, {"loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}


def clip_to_norm(grads: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
    """`grads` scaled to global norm `max_norm` when `norm` exceeds it: what
    ``optax.clip_by_global_norm`` computes, to rounding (one multiply by a
    scalar, which XLA fuses into the optimizer's update of each leaf, where
    optax's per-element divide is a pass of its own)."""
    factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


def batch_rows(batch: PyTree) -> int:
    """The rows of a global `batch`: the leading dimension every array of it
    shares (the dimension the devices split).

    Raises:
      UsageError: a batch with no array, or arrays whose first dimensions
        differ or that have none (each names its path and shape).
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise UsageError(f"the batch holds no array (got {type(batch).__name__})")
    firsts = {jnp.shape(x)[0] if jnp.ndim(x) else None for _, x in leaves}
    if len(firsts) != 1 or None in firsts:
        shapes = ", ".join(f"{jax.tree_util.keystr(k)}: {jnp.shape(x)}" for k, x in leaves)
        raise UsageError(
            f"every array of a batch has its rows first, as many in each: got {shapes}"
        )
    return firsts.pop()


def compile_for_batch(program, batch: dict, compiler_options: dict | None = None):
    """``program.train_step`` compiled, not run, for its abstract state and
    a batch of `batch`'s shapes and dtypes laid out as its batch sharding,
    with `compiler_options` (default: ``program.compiler_options``); on a
    GPU mesh with ``program.links``, scheduled with the collectives' costs
    on those links (`zpp_jax.analysis.compile_with_links`: two compiles).
    `program`: a `TrainingProgram` with a `links` attribute (None: XLA's
    own estimate)."""
    sharding = program.batch_sharding()
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), batch)
    options = program.compiler_options if compiler_options is None else compiler_options
    lowered = program.train_step.lower(program.abstract_state(), batch)
    return compile_with_links(lowered, options, devices_per_node(program.mesh), program.links)
