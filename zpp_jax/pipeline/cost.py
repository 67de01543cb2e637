"""Slice-cost models for the TeraPipe planner: t(b, l, c) = seconds for one
pipeline stage to run the forward and backward pass of a microbatch of `b`
sequences, `l` new tokens each, after a context of `c` tokens.

`LinkCost(compute, ...)` adds to any of them the stage-to-stage transfer
of a slice: its activations forward and their gradient backward, each
``latency + bytes / bandwidth``.

Two compute models share that contract: `AnalyticCost` (FLOPs / device throughput,
plus a fixed per-layer overhead that makes very short slices inefficient)
for planning without a device, and `FittedCost` (measured times: the
no-context time per length, plus the extra time of context, either TeraPipe's
least-squares ``coef . [b*l, b*c, b*l*c]`` or one fitted slope per measured
length), saved to and loaded from JSON. A `FittedCost` may also carry a
per-step overhead of the pipeline runtime (activation transfers and the
stages waiting for each other), calibrated on a real pipeline with
`calibrate_step_overhead`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np

from zpp_jax.errors import UsageError


@dataclasses.dataclass(frozen=True)
class AnalyticCost:
    """GPT-style stage of `layers` blocks (d_model `hidden`, MLP `ffn` =
    4 x hidden by default). Forward + backward = 3 x the forward FLOPs:
    dense 2*b*l*w, with w = `matmul_weights` per layer (default
    4 h^2 + 2 h f, a GPT block's), and attention 4*b*l*(c + (l+1)/2)*h per layer,
    at `flops` per second, plus `overhead_s` per layer and slice. A slice of
    fewer than `saturation_tokens` rows (b*l) takes as long as one of that
    many: small matmuls leave an accelerator idle."""

    hidden: int
    layers: int
    ffn: int | None = None
    flops: float = 1e14
    overhead_s: float = 2e-5
    saturation_tokens: int = 128
    matmul_weights: int | None = None

    def __post_init__(self) -> None:
        optional = tuple(n for n in ("ffn", "matmul_weights") if getattr(self, n) is not None)
        for name in ("hidden", "layers") + optional:
            _number(name, getattr(self, name), minimum=1, integer=True)
        _number("flops", self.flops, minimum=0, strict=True)
        _number("overhead_s", self.overhead_s, minimum=0)
        _number("saturation_tokens", self.saturation_tokens, minimum=1)

    def __call__(self, batch, length, context):
        h = self.hidden
        f = self.ffn or 4 * h
        n = np.asarray(length, np.float64)
        bl = np.asarray(batch, np.float64) * n
        weights = self.matmul_weights or 4 * h * h + 2 * h * f
        dense = 2.0 * bl * weights
        attn = 4.0 * bl * (np.asarray(context, np.float64) + (n + 1) / 2) * h
        # Below `saturation_tokens` rows a matmul takes as long as at that size.
        slow = np.maximum(1.0, self.saturation_tokens / np.maximum(bl, 1.0))
        return self.layers * (self.overhead_s + 3.0 * (dense + attn) * slow / self.flops)

    def to_json(self) -> dict:
        return {"kind": "analytic", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class FittedCost:
    """Measured per-layer times: `base_lengths` / `base_times` (no context,
    b*l tokens, interpolated linearly, extrapolated by the last two points)
    plus the extra time of context, times `layers`, plus `step_overhead`.

    The context term is ``coef . [b*l, b*c, b*l*c]`` or, when
    `context_slopes` is given (seconds per context token, one per base
    length; interpolated and extrapolated like the base times), ``slope(b*l)
    * b*c``: a slope per measured length follows the measurements where the
    three-term fit cannot (cache effects make short slices' slope flat).
    `step_overhead` (seconds) is added once per stage step, not per layer:
    what the runtime spends per step beyond the stage's own compute.
    """

    layers: int
    base_lengths: tuple[int, ...]
    base_times: tuple[float, ...]
    coef: tuple[float, float, float]
    context_slopes: tuple[float, ...] | None = None
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        _numbers("base_lengths", self.base_lengths, minimum=1, integers=True)
        _numbers("base_times", self.base_times, minimum=0)
        _numbers("coef", self.coef, count=3)
        if self.context_slopes is not None:
            _numbers("context_slopes", self.context_slopes)
        if len(self.base_lengths) < 2 or len(self.base_lengths) != len(self.base_times):
            raise UsageError("a fitted cost needs >= 2 (length, time) points of equal count")
        if list(self.base_lengths) != sorted(set(self.base_lengths)):
            raise UsageError("base_lengths must be strictly increasing")
        if not isinstance(self.layers, int) or isinstance(self.layers, bool) or self.layers <= 0:
            raise UsageError(f"layers must be a positive int, got {self.layers!r}")
        if self.context_slopes is not None and len(self.context_slopes) != len(self.base_lengths):
            raise UsageError("context_slopes needs one slope per base length")
        _number("step_overhead", self.step_overhead, minimum=0)

    def __call__(self, batch, length, context):
        bl = np.asarray(batch, np.float64) * np.asarray(length, np.float64)
        bc = np.asarray(batch, np.float64) * np.asarray(context, np.float64)
        base = _monotone_interp(bl, self.base_lengths, self.base_times)
        if self.context_slopes is not None:
            extra = _monotone_interp(bl, self.base_lengths, self.context_slopes) * bc
        else:
            extra = self.coef[0] * bl + self.coef[1] * bc + self.coef[2] * bl * np.asarray(context)
        # Context never makes a slice faster: a fit that dips below the
        # measured no-context time (noise on short slices) is held there.
        return self.layers * np.maximum(base + extra, base) + self.step_overhead

    def to_json(self) -> dict:
        return {"kind": "fitted", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """`compute`'s slice time plus the slice's transfers between stages:
    its activations (b * l * `hidden` values of `value_bytes` bytes) to the
    next stage in the forward pass and their gradient back in the backward
    pass, each `latency_s` + bytes / `bytes_per_s`.

    The bandwidth and latency come from the flags (`--link-gbps`,
    `--link-latency-us`) or from a measured transfer between two processes
    (`zpp profile --link`, `zpp_jax.pipeline.profile.measure_link`)."""

    compute: Any
    hidden: int
    bytes_per_s: float
    latency_s: float = 0.0
    value_bytes: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.hidden, int) or isinstance(self.hidden, bool) or self.hidden <= 0:
            raise UsageError(f"hidden must be a positive int, got {self.hidden!r}")
        _number("bytes_per_s", self.bytes_per_s, minimum=0, strict=True)
        _number("latency_s", self.latency_s, minimum=0)
        if self.value_bytes not in (1, 2, 4, 8):
            raise UsageError(f"value_bytes must be 1, 2, 4 or 8, got {self.value_bytes!r}")

    def transfer(self, batch, length):
        """Seconds of one slice's transfers (forward and backward)."""
        nbytes = np.asarray(batch, np.float64) * np.asarray(length, np.float64) * self.hidden
        return 2.0 * (self.latency_s + nbytes * self.value_bytes / self.bytes_per_s)

    def __call__(self, batch, length, context):
        return self.compute(batch, length, context) + self.transfer(batch, length)

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        fields["compute"] = self.compute.to_json()
        return {"kind": "link", **fields}


def _numbers(name, values, minimum=None, count=None, integers=False, strict=False) -> None:
    """Raise UsageError unless `values` is a sequence of finite numbers (of
    `count` items, >= `minimum`, or > it when `strict`, ints if `integers`)."""
    kind = "ints" if integers else "numbers"
    ok = isinstance(values, list | tuple) and all(
        isinstance(v, int if integers else int | float) and not isinstance(v, bool) for v in values
    )
    ok = ok and all(np.isfinite(v) for v in values) and (count is None or len(values) == count)
    if ok and minimum is not None:
        ok = all(v > minimum if strict else v >= minimum for v in values)
    if not ok:
        what = f"{count} finite {kind}" if count else f"finite {kind}"
        if minimum is not None:
            what += f" {'>' if strict else '>='} {minimum}"
        raise UsageError(f"{name} must be {what}, got {values!r}")


def _number(name, value, minimum=None, integer=False, strict=False) -> None:
    """`_numbers` for one value, with a message about one value."""
    try:
        _numbers(name, (value,), minimum=minimum, integers=integer, strict=strict)
    except UsageError:
        what = "an int" if integer else "a finite number"
        if minimum is not None:
            what += f" {'>' if strict else '>='} {minimum}"
        raise UsageError(f"{name} must be {what}, got {value!r}") from None


def _monotone_interp(x, xs, ys):
    """Piecewise-linear in x through (xs, ys), extrapolated by the last two
    points; non-decreasing. A longer slice never takes less time (nor less
    per context token): noise in the measurements must not make the model
    or its extrapolation decrease."""
    xs = np.asarray(xs, np.float64)
    ys = np.maximum.accumulate(np.maximum(np.asarray(ys, np.float64), 0.0))
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * slope, np.interp(x, xs, ys))


def save_cost(model, path: str | pathlib.Path) -> None:
    """Write a cost model as JSON (`load_cost` reads it), making its folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model.to_json(), indent=1))


def load_cost(path: str | pathlib.Path):
    """An `AnalyticCost` or `FittedCost` from the JSON `save_cost` wrote."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read a cost model from {path}: {e}") from None
    try:
        return cost_from_json(data)
    except UsageError as e:
        raise UsageError(f"{path}: {e}") from None


def cost_from_json(data: Any):
    """The cost model a `to_json()` dict describes; UsageError naming the
    field for anything malformed."""
    if not isinstance(data, dict):
        raise UsageError(f"a cost model is a JSON object with a 'kind', got {type(data).__name__}")
    data = dict(data)
    kind = data.pop("kind", None)
    models = {"analytic": AnalyticCost, "fitted": FittedCost, "link": LinkCost}
    if kind not in models:
        raise UsageError(f"unknown cost model kind {kind!r} (analytic, fitted or link)")
    if kind == "link":
        data["compute"] = cost_from_json(data.get("compute"))
    # JSON has lists where the dataclasses hold tuples (hashable, frozen).
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return models[kind](**fields)
    except TypeError as e:
        raise UsageError(f"not a {kind} cost model: {e}") from None
