"""`zpp profile`: measure one pipeline stage on this device and fit a cost model.

For each (slice length l, context c) of a grid, `profile_stage` times the
forward and backward pass of what one `TokenPipeline` stage runs in one step:
`layers` decoder layers (of any model with a `PipelineDecoder`) over a slice
of l tokens attending to c cached tokens plus itself, then the LM head and
loss (the runtime runs the head on every stage; the embedding is
negligible). It fits the model: the measured
no-context time per length, plus the extra time of context as one
least-squares slope per length (and TeraPipe's fit on [b*c, b*l*c], kept for
reference), and returns a `FittedCost` the planner reads.

What one stage step in isolation does not show, the activation transfer
between stages, `measure_link` measures: a real point-to-point transfer
between two processes (`zpp profile --link`), fitted as latency + bytes /
bandwidth, which `LinkCost` adds to each slice. `calibrate_step_overhead`
instead fits a per-step overhead to one measured run of the real pipeline.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zpp_jax.errors import UsageError
from zpp_jax.pipeline.cost import FittedCost
from zpp_jax.pipeline.decoders import decoder_for, split_part
from zpp_jax.pipeline.planner import latency


def stage_step_fn(
    make_model: Callable[[int], nnx.Module],
    layers: int,
    batch: int,
    length: int,
    context: int,
    cache_len: int | None = None,
):
    """A jitted fwd+bwd of one stage step and its inputs: ``f(*args)``.

    `make_model(layers)` builds the decoder with that many layers (its
    `PipelineDecoder` says how a stage runs it). `cache_len` is the
    key/value cache the step updates (the runtime's is the sequence plus the
    longest slice; default: just the keys it reads)."""
    model = make_model(layers)
    dec = decoder_for(model)
    parts = dec.parts(model)
    block_def, block_params, block_rest = split_part(parts.pop("blocks"))
    keys = context + length
    x = jnp.ones((batch, length, dec.d_model), dec.dtype)
    cache_len = keys if cache_len is None else max(cache_len, keys)
    cache = jnp.ones((layers, 2, batch, cache_len, dec.kv_width), dec.dtype) * 0.01
    targets = jnp.zeros((batch, length), jnp.int32)

    def loss(block_params, x, cache):
        def layer(x, xs):
            p, kv = xs
            return dec.layer(nnx.merge(block_def, p, block_rest), x, kv, context, keys)

        y, cache = jax.lax.scan(layer, x, (block_params, cache))
        logp = jax.nn.log_softmax(dec.head(parts, y), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)
        return jnp.sum(nll) + jnp.sum(cache[:, :, :, :1].astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (block_params, x, cache)


def time_call(fn, args, repeats: int = 5) -> float:
    """Median seconds of `fn(*args)` after one warm-up call (compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_stage(
    make_model: Callable[[int], nnx.Module],
    layers: int,
    lengths: list[int],
    contexts: list[int],
    batch: int = 1,
    repeats: int = 5,
    log=None,
    seq_len: int | None = None,
) -> tuple[FittedCost, list[dict]]:
    """Time the grid and fit; returns the model and the measurements
    ``[{"length", "context", "seconds"}]``. With `seq_len`, every step
    updates a cache of seq_len + length positions, as the runtime's does."""
    if not lengths or min(lengths) <= 0 or any(c < 0 for c in contexts):
        raise UsageError("lengths must be positive and contexts non-negative")
    rows = []
    for length in sorted(set(lengths)):
        for context in sorted({0, *contexts}):
            cache_len = None if seq_len is None else seq_len + length
            fn, args = stage_step_fn(make_model, layers, batch, length, context, cache_len)
            t = time_call(fn, args, repeats)
            rows.append({"length": length, "context": context, "seconds": t})
            if log:
                log(f"l={length:5d} c={context:5d}: {t * 1e3:9.3f} ms")
    return fit(rows, batch), rows


def fit(rows: list[dict], batch: int = 1) -> FittedCost:
    """The no-context times as measured; the extra time of context as a
    least-squares slope (seconds per context token) per length, through
    zero at no context, when every length has a time with context. Also
    TeraPipe's fit on [b*c, b*l*c] (weighted by 1 / measured time), which
    the model uses when there are no per-length slopes. Both terms are zero
    without context, so the measured times stay exact there. The model's
    `layers` is 1: the times are already of a whole stage."""
    base = {r["length"]: r["seconds"] for r in rows if r["context"] == 0}
    if len(base) < 2:
        raise UsageError("the fit needs no-context times of at least two lengths")
    extra = [r for r in rows if r["context"] > 0]
    if extra:
        a = np.array(
            [[batch * r["context"], batch * r["length"] * r["context"]] for r in extra],
            np.float64,
        )
        y = np.array([r["seconds"] - base[r["length"]] for r in extra], np.float64)
        # Relative residuals: slices from tens of tokens to the whole
        # sequence differ 100x in time, and the short ones must fit too.
        w = 1.0 / np.array([r["seconds"] for r in extra], np.float64)
        c1, c2 = (float(v) for v in np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0])
        coef = (0.0, c1, c2)
    else:
        coef = (0.0, 0.0, 0.0)
    lengths = sorted(base)
    slopes = None
    if all(any(r["length"] == n for r in extra) for n in lengths):
        slopes = []
        for n in lengths:
            c = np.array([batch * r["context"] for r in extra if r["length"] == n], np.float64)
            y = np.array([r["seconds"] - base[n] for r in extra if r["length"] == n], np.float64)
            slopes.append(float(c @ y / (c @ c)))
        slopes = tuple(slopes)
    return FittedCost(
        layers=1,
        base_lengths=tuple(batch * n for n in lengths),
        base_times=tuple(base[n] for n in lengths),
        coef=coef,
        context_slopes=slopes,
    )


def calibrate_step_overhead(
    cost: FittedCost, slices, stages: int, measured_s: float, batch: int = 1
) -> FittedCost:
    """`cost` with the `step_overhead` that makes the lockstep prediction of
    `slices` on `stages` stages equal `measured_s` (a measured step time of
    the real pipeline), spread evenly over its len(slices) + stages - 1
    steps; never negative (a measurement below the prediction leaves 0).
    Calibrate on a slicing with many short slices, where the overhead is a
    large share of the time, and report predictions for other slicings."""
    if not measured_s > 0:
        raise UsageError(f"measured_s must be a positive time, got {measured_s!r}")
    base = dataclasses.replace(cost, step_overhead=0.0)
    predicted = latency(slices, base, stages, batch, objective="lockstep")
    steps = len(slices) + stages - 1
    return dataclasses.replace(base, step_overhead=max(0.0, (measured_s - predicted) / steps))


# Up to 64 MiB: at the large sizes the transfer, not the latency or a
# scheduling stall of a loaded host, decides the time, so the fitted
# bandwidth holds on fast links and on shared machines alike.
LINK_SIZES = (4096, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


def measure_link(sizes=LINK_SIZES, repeats: int = 7) -> dict:
    """Time a point-to-point transfer of each size in `sizes` (bytes) from
    process 0 to process 1 of a 2-process job (`jax.distributed`), as the
    pipeline moves a slice's activations: a `lax.ppermute` between the
    first device of each process. Fits seconds = latency + bytes /
    bandwidth by least squares over the medians (each of `repeats` calls
    after one warm-up); returns ``{"bytes_per_s", "latency_s", "points"}``.
    Every process of the job must call it."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.process_count() != 2:
        raise UsageError(
            f"measure_link runs in a job of 2 processes, this one has {jax.process_count()}; "
            "start it with zpp profile --link"
        )
    devices = [
        min((d for d in jax.devices() if d.process_index == i), key=lambda d: d.id)
        for i in range(2)
    ]
    mesh = Mesh(np.array(devices), ("link",))
    sharding = NamedSharding(mesh, P("link"))
    send = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.ppermute(x, "link", [(0, 1)]),
            mesh=mesh,
            in_specs=P("link"),
            out_specs=P("link"),
        )
    )
    points = []
    for nbytes in sorted(set(int(n) for n in sizes)):
        n = max(1, nbytes // 4)
        x = jax.make_array_from_callback(
            (2 * n,), sharding, lambda idx, n=n: np.ones(n, np.float32)
        )
        points.append({"bytes": 4 * n, "seconds": time_call(send, (x,), repeats)})
    a = np.array([[1.0, p["bytes"]] for p in points])
    y = np.array([p["seconds"] for p in points])
    latency, per_byte = np.linalg.lstsq(a, y, rcond=None)[0]
    if not per_byte > 0:
        raise UsageError(
            f"the transfer times {[round(p['seconds'] * 1e3, 3) for p in points]} ms do not "
            "grow with size; measure larger sizes"
        )
    return {
        "bytes_per_s": float(1.0 / per_byte),
        "latency_s": float(max(latency, 0.0)),
        "points": points,
    }
