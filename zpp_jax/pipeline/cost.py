"""Slice-cost models for the TeraPipe planner: t(b, l, c) = seconds for one
pipeline stage to run the forward and backward pass of a microbatch of `b`
sequences, `l` new tokens each, after a context of `c` tokens.

Two models share that contract: `AnalyticCost` (FLOPs / device throughput,
plus a fixed per-layer overhead that makes very short slices inefficient)
for planning without a device, and `FittedCost` (TeraPipe's least-squares fit
of measured times: measured no-context time per length, plus
``coef . [b*l, b*c, b*l*c]`` for the context), saved to and loaded from JSON.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class AnalyticCost:
    """GPT-style stage of `layers` blocks (d_model `hidden`, MLP `ffn` =
    4 x hidden by default). Forward + backward = 3 x the forward FLOPs:
    dense 2*b*l*(4 h^2 + 2 h f) and attention 4*b*l*(c + (l+1)/2)*h per layer,
    at `flops` per second, plus `overhead_s` per layer and slice. A slice of
    fewer than `saturation_tokens` rows (b*l) takes as long as one of that
    many: small matmuls leave an accelerator idle."""

    hidden: int
    layers: int
    ffn: int | None = None
    flops: float = 1e14
    overhead_s: float = 2e-5
    saturation_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("hidden", "layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.ffn is not None and (not isinstance(self.ffn, int) or self.ffn <= 0):
            raise ValueError(f"ffn must be a positive int, got {self.ffn!r}")
        if not self.flops > 0 or not self.overhead_s >= 0 or not self.saturation_tokens >= 1:
            raise ValueError("flops must be > 0, overhead_s >= 0, saturation_tokens >= 1")

    def __call__(self, batch, length, context):
        h = self.hidden
        f = self.ffn or 4 * h
        n = np.asarray(length, np.float64)
        bl = np.asarray(batch, np.float64) * n
        dense = 2.0 * bl * (4 * h * h + 2 * h * f)
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
    plus ``coef . [b*l, b*c, b*l*c]`` for the context, times `layers`."""

    layers: int
    base_lengths: tuple[int, ...]
    base_times: tuple[float, ...]
    coef: tuple[float, float, float]

    def __post_init__(self) -> None:
        if len(self.base_lengths) < 2 or len(self.base_lengths) != len(self.base_times):
            raise ValueError("a fitted cost needs >= 2 (length, time) points of equal count")
        if list(self.base_lengths) != sorted(set(self.base_lengths)):
            raise ValueError("base_lengths must be strictly increasing")
        if not isinstance(self.layers, int) or self.layers <= 0:
            raise ValueError(f"layers must be a positive int, got {self.layers!r}")

    def __call__(self, batch, length, context):
        bl = np.asarray(batch, np.float64) * np.asarray(length, np.float64)
        bc = np.asarray(batch, np.float64) * np.asarray(context, np.float64)
        xs = np.asarray(self.base_lengths, np.float64)
        # A longer slice never takes less time: noise in the measurements
        # must not make the model (or its extrapolation) decrease.
        ys = np.maximum.accumulate(np.asarray(self.base_times, np.float64))
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        base = np.where(bl > xs[-1], ys[-1] + (bl - xs[-1]) * slope, np.interp(bl, xs, ys))
        extra = self.coef[0] * bl + self.coef[1] * bc + self.coef[2] * bl * np.asarray(context)
        # Context never makes a slice faster: a fit that dips below the
        # measured no-context time (noise on short slices) is held there.
        return self.layers * np.maximum(base + extra, base)

    def to_json(self) -> dict:
        return {"kind": "fitted", **dataclasses.asdict(self)}


def save_cost(model, path: str | pathlib.Path) -> None:
    pathlib.Path(path).write_text(json.dumps(model.to_json(), indent=1))


def load_cost(path: str | pathlib.Path):
    """An `AnalyticCost` or `FittedCost` from the JSON `save_cost` wrote."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read a cost model from {path}: {e}") from None
    kind = data.pop("kind", None)
    if kind == "analytic":
        return AnalyticCost(**data)
    if kind == "fitted":
        return FittedCost(
            layers=data["layers"],
            base_lengths=tuple(data["base_lengths"]),
            base_times=tuple(data["base_times"]),
            coef=tuple(data["coef"]),
        )
    raise ValueError(f"{path}: unknown cost model kind {kind!r} (analytic or fitted)")
