"""TeraPipe runtime: a decoder LM as K pipeline stages over token slices.

`TokenPipeline(model, mesh, slices)` runs an NNX decoder (`zpp_jax.models`'
`GPT` or `Llama`, or any model with a `PipelineDecoder`) on a mesh with a
`stage` axis of K devices: stage k holds layers [k L/K, (k+1) L/K); the
embedding runs on the first stage, the final norm, LM head and loss on the
last. One sequence (or a microbatch of sequences, all cut the
same way) is cut into the token slices `slices` (any lengths, e.g. a
`zpp_jax.pipeline.plan_tokens` plan) which flow through the stages.

Schedule: one SPMD program in lockstep. At step s (0 <= s < M + K - 1) stage
k runs slice s - k (if there is one), every stage padded to the longest
slice active in that step; the activations move to the next stage with
`lax.ppermute`. Each stage keeps, per layer, the keys and values of the
slices it has run (a cache of the whole sequence) and a slice attends to the
cached prefix plus itself, causally. The backward pass is reverse-mode
autodiff of that forward schedule: it runs the steps in reverse, and the
gradients flowing into cached keys and values of earlier slices are added to
those slices' backward by the cache updates' transposes. Gradients equal the
unpipelined model's (to fp32 round-off). `zpp_jax.pipeline.latency(...,
objective="lockstep")` models exactly this schedule's cost.

On a (`stage`, `node`, `local`) mesh the batch is split over node x local
(data parallel inside each stage). With `zero` (a `ZeroPPConfig`) each
stage's layers are sharded over its node x local devices as flat primary
shards (ZeRO-3, or ZeRO++ with the config's techniques). Each layer's weight
is gathered once per training step, before the first pipeline step
(`ShardedLayer.held`: qwZ codes over the wire, hierarchically with hpZ), and
held by the stage for the whole forward schedule and its backward; the
gradient summed over every pipeline step is reduced once (qgZ or
reduce-scatter, with error feedback if configured). Re-gathering per
pipeline step would cost M + K - 1 cross-node gathers per layer (or, with
hpZ, that many gathers inside the node) to hold one layer at a time.
Without `zero` the layers are replicated over node x local and their
gradients averaged by an all-reduce.

Memory per device: the stage's parameters (with `zero`, 1/(node x local)
of them, plus the held full weights of its layers/K layers in their own
dtype during a step), a key/value cache of 2 x layers/K x batch x
(seq + longest slice) x `kv_width` (d_model for the GPT, the key/value
heads' width for the Llama), and autodiff's residuals for every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.layer import ShardedLayer
from zpp_jax.mesh import AXES, STAGE
from zpp_jax.partition import FlatLayout
from zpp_jax.pipeline.decoders import PipelineDecoder, decoder_for, split_part

# Each slice adds a pipeline step to the unrolled program: its compile time
# and size grow with the count (a plan at the automatic granularity has at
# most 256).
MAX_SLICES = 512


class TokenPipeline:
    """Loss and gradients of a decoder LM trained as a token-level pipeline.

    ``params = pipe.params()`` lays the model's parameters out for the mesh
    (the layers as `blocks`, stacked to (K, L/K, ...) and sharded over
    `stage`; the decoder's other parts replicated); ``loss, grads =
    pipe.value_and_grad(params, tokens, targets)`` (jitted) returns the mean
    next-token loss and gradients in the same layout; ``pipe.loss(params,
    tokens, targets)`` the loss alone.
    `tokens`, `targets`: int32 (batch, seq_len). With error feedback use
    ``loss, grads, residuals = pipe.value_grad_residuals(params, residuals,
    tokens, targets)``, starting from ``pipe.init_residuals()``.
    """

    def __init__(
        self,
        model: nnx.Module,
        mesh: Mesh,
        slices: Sequence[int],
        zero: ZeroPPConfig | None = None,
        *,
        decoder: PipelineDecoder | None = None,
    ) -> None:
        if STAGE not in mesh.axis_names:
            raise UsageError(f"the mesh needs a {STAGE!r} axis, it has {mesh.axis_names}")
        if zero is not None and any(a not in mesh.axis_names for a in AXES):
            raise UsageError(
                f"ZeRO inside the stages needs a ({STAGE!r}, 'node', 'local') mesh, it has "
                f"{mesh.axis_names}"
            )
        self.stages = mesh.shape[STAGE]
        dec = self.decoder = decoder if decoder is not None else decoder_for(model)
        if dec.n_layers % self.stages:
            raise UsageError(
                f"{dec.n_layers} layers do not split evenly over {self.stages} stages; "
                "use a number of stages that divides the layer count"
            )
        slices = tuple(int(s) for s in slices)
        if not slices or min(slices) <= 0:
            raise UsageError(f"slices must be positive token counts, got {slices}")
        if len(slices) > MAX_SLICES:
            raise UsageError(
                f"{len(slices)} slices: the schedule is unrolled into the compiled program "
                f"(M + K - 1 pipeline steps for M slices), so at most {MAX_SLICES} slices; "
                "cut the sequence into fewer, longer slices (`zpp train --slices N` is a "
                "count of equal slices, --slices 1 is no slicing)"
            )
        if sum(slices) != dec.seq_len:
            raise UsageError(
                f"the slices {slices} add up to {sum(slices)} tokens, the model's "
                f"sequences have {dec.seq_len}"
            )
        self.mesh, self.slices = mesh, slices
        self.per_stage = dec.n_layers // self.stages
        # The data-parallel axes inside a stage (none on a stage-only mesh).
        self.dp_axes = tuple(a for a in AXES if a in mesh.axis_names)
        self.dp = int(np.prod([mesh.shape[a] for a in self.dp_axes]))
        self._graph = {name: split_part(part) for name, part in dec.parts(model).items()}
        # Parts outside the layer stack: replicated, run on the first or last stage.
        self._outer = tuple(name for name in self._graph if name != "blocks")
        self.zero = zero
        if zero is not None:
            self.layout = FlatLayout.from_tree(
                self._graph["blocks"][1], self.dp, stacked=True, align=zero.alignment
            )
            # Only `held` is used: the pipeline runs the layers itself.
            self.layer = ShardedLayer(_not_called, self.layout, zero, compute_dtype=None)
        self.value_and_grad = jax.jit(self._value_and_grad)
        self.value_grad_residuals = jax.jit(self._value_grad_residuals)
        self.loss = jax.jit(self._loss)

    @property
    def error_feedback(self) -> bool:
        return self.zero is not None and self.zero.error_feedback

    def params(self) -> dict:
        """The model's parameters laid out for the pipeline mesh."""
        p = {name: g[1] for name, g in self._graph.items()}
        k, per = self.stages, self.per_stage
        if self.zero is not None:
            flat = jax.vmap(self.layout.flatten)(p["blocks"])
            p["blocks"] = flat.reshape(k, per, -1)
        else:
            p["blocks"] = jax.tree.map(lambda a: a.reshape(k, per, *a.shape[1:]), p["blocks"])
        return jax.device_put(p, self.shardings(p))

    def shardings(self, params: dict) -> dict:
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self._specs(params))

    def init_residuals(self) -> jax.Array:
        """Zero error-feedback residuals: (K, layers/K, devices x r), laid out
        like the block shards (r = `ShardedLayer.residual_size` per device)."""
        if not self.error_feedback:
            raise UsageError("error-feedback residuals need zero=ZeroPPConfig(error_feedback=True)")
        nodes, local = self.mesh.shape["node"], self.mesh.shape["local"]
        size = self.dp * self.layer.residual_size(nodes, local)
        sharding = NamedSharding(self.mesh, P(STAGE, None, AXES))
        return jnp.zeros(
            (self.stages, self.per_stage, size), self.zero.residual_dtype, device=sharding
        )

    def batch_sharding(self) -> NamedSharding:
        """Tokens and targets: rows split over the data-parallel axes,
        replicated over the stages."""
        return NamedSharding(self.mesh, P(self.dp_axes) if self.dp_axes else P())

    def unstack(self, grads_or_params: dict) -> dict:
        """`blocks` back to a (L, ...) stack of the layers' parameters."""
        out = dict(grads_or_params)
        blocks = grads_or_params["blocks"]
        if self.zero is not None:
            out["blocks"] = jax.vmap(self.layout.unflatten)(blocks.reshape(-1, blocks.shape[-1]))
        else:
            out["blocks"] = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), blocks)
        return out

    def _specs(self, params: dict) -> dict:
        """`blocks` split over the stages (and, with ZeRO, their flat shards
        over node x local), everything else replicated."""
        block = P(STAGE, None, AXES) if self.zero is not None else P(STAGE)
        out = {}
        for name, tree in params.items():
            spec = block if name == "blocks" else P()
            out[name] = jax.tree.map(lambda _, spec=spec: spec, tree)
        return out

    # -- the schedule ------------------------------------------------------------

    def _value_and_grad(self, params, tokens, targets):
        if self.error_feedback:
            raise UsageError(
                "error feedback carries residuals between steps: use value_grad_residuals"
            )
        loss, grads, _ = self._value_grad_residuals(params, None, tokens, targets)
        return loss, grads

    def _value_grad_residuals(self, params, residuals, tokens, targets):
        spec = self._specs(params)
        dp, zero = self.dp_axes, self.zero is not None
        res_spec = P(STAGE, None, AXES) if residuals is not None else None

        def local(params, residuals, tokens, targets):
            params = dict(params, blocks=jax.tree.map(lambda a: a[0], params["blocks"]))
            res = None if residuals is None else residuals[0]
            loss, (grads, res) = jax.value_and_grad(self._local_loss, argnums=(0, 1))(
                params, res, tokens, targets
            )
            # The outer parts are replicated: their gradient is the sum of
            # every stage's (zero except on the first / last stage), averaged
            # over the data-parallel devices. ZeRO layers reduce their own;
            # replicated layers are averaged here.
            for name in self._outer:
                grads[name] = lax.psum(grads[name], STAGE)
            for name in self._outer if zero else (*self._outer, "blocks"):
                if dp:
                    grads[name] = lax.pmean(grads[name], dp)
            grads["blocks"] = jax.tree.map(lambda a: a[None], grads["blocks"])
            loss = lax.psum(loss, STAGE)
            loss = lax.pmean(loss, dp) if dp else loss
            return loss, grads, (None if res is None else res[None])

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(spec, res_spec, self.batch_sharding().spec, self.batch_sharding().spec),
            out_specs=(P(), spec, res_spec),
            check_vma=False,
        )(params, residuals, tokens, targets)

    def _loss(self, params, tokens, targets):
        spec = self._specs(params)
        dp = self.dp_axes

        def local(params, tokens, targets):
            params = dict(params, blocks=jax.tree.map(lambda a: a[0], params["blocks"]))
            res = None
            if self.error_feedback:  # the forward pass does not read it
                nodes, local = self.mesh.shape["node"], self.mesh.shape["local"]
                size = self.layer.residual_size(nodes, local)
                res = jnp.zeros((self.per_stage, size), self.zero.residual_dtype)
            loss = lax.psum(self._local_loss(params, res, tokens, targets), STAGE)
            return lax.pmean(loss, dp) if dp else loss

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(spec, self.batch_sharding().spec, self.batch_sharding().spec),
            out_specs=P(),
            check_vma=False,
        )(params, tokens, targets)

    def _stage_weights(self, blocks, residuals):
        """This stage's layers as (layers/K, ...) parameter trees: gathered
        once per step with ZeRO (`ShardedLayer.held`), else as they are."""
        if self.zero is None:
            return blocks

        def gather(_, xs):
            shard, residual = xs
            return None, self.layer.held(shard, residual)

        return lax.scan(gather, None, (blocks, residuals))[1]

    def _local_loss(self, params, residuals, tokens, targets):
        """This stage's share of the mean loss (non-zero on the last stage)."""
        dec, k_stages, slices = self.decoder, self.stages, self.slices
        b = tokens.shape[0]
        m = len(slices)
        starts = np.concatenate([[0], np.cumsum(slices)[:-1]]).astype(np.int32)
        pmax = max(slices)
        seq = dec.seq_len
        stage = lax.axis_index(STAGE)
        first, last = stage == 0, stage == k_stages - 1

        outer = {
            name: nnx.merge(self._graph[name][0], params[name], self._graph[name][2])
            for name in self._outer
        }
        block_def, _, block_rest = self._graph["blocks"]
        weights = self._stage_weights(params["blocks"], residuals)
        dtype = dec.dtype
        # Room past the sequence: padded rows and idle stages write there.
        tokens = jnp.pad(tokens, ((0, 0), (0, pmax)))
        targets = jnp.pad(targets, ((0, 0), (0, pmax)))
        cache = jnp.zeros((self.per_stage, 2, b, seq + pmax, dec.kv_width), dtype)
        carry = jnp.zeros((b, pmax, dec.d_model), dtype)
        total = jnp.zeros((), jnp.float32)

        for step in range(m + k_stages - 1):
            active = [i for i in range(step - k_stages + 1, step + 1) if 0 <= i < m]
            pad = max(slices[i] for i in active)
            keys = max(int(starts[i]) + slices[i] for i in active)  # static bound
            i = step - stage
            on = (i >= 0) & (i < m)
            ic = jnp.clip(i, 0, m - 1)
            start = jnp.where(on, jnp.asarray(starts)[ic], seq)
            length = jnp.where(on, jnp.asarray(slices, np.int32)[ic], 0)

            tok = lax.dynamic_slice_in_dim(tokens, start, pad, axis=1)
            x = jnp.where(first, dec.embed(outer, tok, start), carry[:, :pad])

            def layer(x, xs, start=start, keys=keys):
                p, kv = xs
                return dec.layer(nnx.merge(block_def, p, block_rest), x, kv, start, keys)

            x, cache = lax.scan(layer, x, (weights, cache))

            logits = dec.head(outer, x)
            tgt = lax.dynamic_slice_in_dim(targets, start, pad, axis=1)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
            valid = (jnp.arange(pad) < length)[None, :]
            total = total + jnp.where(last, jnp.sum(jnp.where(valid, nll, 0.0)), 0.0)

            if step + 1 < m + k_stages - 1:
                # Padded, not scattered into zeros: a scatter's index array is
                # empty here, and jaxlib 0.11.2 crashes compiling a zero-size
                # array that enters a shard_map (`zpp_jax._compat`).
                out = jnp.pad(x.astype(dtype), ((0, 0), (0, pmax - pad), (0, 0)))
                perm = [(s, s + 1) for s in range(k_stages - 1)]
                carry = lax.ppermute(out, STAGE, perm) if perm else out
        return total / (b * seq)


def _not_called(params, x):
    raise AssertionError("TokenPipeline runs its layers through its decoder")
