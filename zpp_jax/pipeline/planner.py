"""TeraPipe's slicing planner: where to cut one sequence (or a batch) into
token slices for a K-stage pipeline.

Objectives (``latency(slices)``; t_i = cost(b, l_i, c_i), c_i = l_1 + ... + l_{i-1}):

- ``"pipeline"`` (the paper's): sum_i t_i + (K - 1) * max_i t_i, an
  asynchronous pipeline where a stage starts a slice as soon as it arrives;
- ``"lockstep"``: what one SPMD program executes. At step s every stage k runs
  slice s - k at the same time, all padded to the longest slice active in that
  step, so the step costs max over its active slices of cost(b, l_pad, c_i)
  and the latency is the sum over the M + K - 1 steps.

`plan_tokens` solves the pipeline objective exactly with the paper's dynamic
program: for each candidate bound t_max on one slice's time (every distinct
value of the cost table, ascending),
S(i) = min_k S(i - k) + t(k, i - k) over slices with t <= t_max, and
T(t_max) = S(L) + (K - 1) * t_max; it stops once (K - 1) * t_max alone exceeds
the best T. The DP runs over positions in units of `granularity` tokens and,
vectorized over a chunk of candidates, costs O(n^2) numpy work per chunk.
For the lockstep objective it evaluates every DP solution met on the way
(and every uniform slicing) under that objective and keeps the best.
`plan_batch` adds the paper's second DP, over how a batch splits into
microbatches, each with its own token slicing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from zpp_jax.errors import UsageError

Cost = Callable[..., object]  # cost(batch, length, context) -> seconds, numpy-broadcasting
OBJECTIVES = ("pipeline", "lockstep")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Token slice lengths (summing to the sequence length) of `batch`
    sequences, and the latency the objective predicts for them."""

    slices: tuple[int, ...]
    latency: float
    objective: str
    batch: int = 1

    @property
    def contexts(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.slices[:-1]))


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Microbatches (size, token slicing) run one after another through the
    pipeline, and the predicted pipeline latency of the whole batch."""

    microbatches: tuple[tuple[int, tuple[int, ...]], ...]
    latency: float


def slice_times(slices: Sequence[int], cost: Cost, batch: int = 1) -> np.ndarray:
    lengths = np.asarray(slices, np.int64)
    contexts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.asarray(cost(batch, lengths, contexts), np.float64).reshape(-1)


def latency(
    slices: Sequence[int], cost: Cost, stages: int, batch: int = 1, objective: str = "pipeline"
) -> float:
    """Predicted step latency of a slicing under `objective` (see the module)."""
    _check(stages=stages, objective=objective)
    if objective == "pipeline":
        t = slice_times(slices, cost, batch)
        return float(t.sum() + (stages - 1) * t.max())
    lengths = np.asarray(slices, np.int64)
    contexts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    m = len(lengths)
    total = 0.0
    for step in range(m + stages - 1):
        active = np.arange(max(0, step - stages + 1), min(m, step + 1))
        pad = lengths[active].max()
        total += float(np.max(np.asarray(cost(batch, pad, contexts[active]), np.float64)))
    return total


def uniform_slicing(seq_len: int, slices: int) -> tuple[int, ...]:
    """`slices` slices as equal as possible (the first ones one token longer)."""
    q, r = divmod(seq_len, slices)
    return tuple(q + 1 if i < r else q for i in range(slices))


MAX_BYTES = 4 * 2**30  # what a plan may allocate unless told otherwise


def plan_bytes(seq_len: int, granularity: int, chunk: int = 256, tables: int = 1) -> int:
    """Bytes the planner allocates at its peak: `tables` cost tables of
    (units + 1)^2 float64 (and the index grids that build one), plus the
    DP's per-chunk arrays, (chunk, units + 1) values and choices for each
    table and the (chunk, units) candidates of one position."""
    n = seq_len // granularity + 1
    return 8 * (tables * n * n + 4 * n * n) + 8 * chunk * n * (2 * tables + 2)


def _check_memory(seq_len, granularity, chunk, tables, max_bytes) -> None:
    need = plan_bytes(seq_len, granularity, chunk, tables)
    if need > max_bytes:
        fine = auto_granularity(seq_len)
        raise UsageError(
            f"planning {seq_len} tokens at granularity {granularity} "
            f"({seq_len // granularity} units) needs about {need / 2**30:.1f} GiB, over the "
            f"{max_bytes / 2**30:.1f} GiB allowed; use a coarser granularity (e.g. {fine}, "
            "what leaving it out chooses)"
        )


def auto_granularity(seq_len: int, max_units: int = 256) -> int:
    """The finest granularity (tokens per planning unit) that divides
    `seq_len` into at most `max_units` units. The DP's cost table has
    units^2 entries and each bound costs units^2 work, so the unit count,
    not the sequence length, bounds the planner's time and memory."""
    _units(seq_len, 1)
    for g in range(max(1, -(-seq_len // max_units)), seq_len + 1):
        if seq_len % g == 0:
            return g
    return seq_len


def best_uniform(
    seq_len: int,
    stages: int,
    cost: Cost,
    granularity: int = 1,
    batch: int = 1,
    objective: str = "pipeline",
) -> Plan:
    """The best slicing into M equal slices of whole `granularity` units."""
    n = _units(seq_len, granularity)
    plans = [
        Plan(s, latency(s, cost, stages, batch, objective), objective, batch)
        for s in (tuple(u * granularity for u in uniform_slicing(n, m)) for m in range(1, n + 1))
    ]
    return min(plans, key=lambda p: p.latency)


def plan_tokens(
    seq_len: int,
    stages: int,
    cost: Cost,
    granularity: int | None = None,
    batch: int = 1,
    objective: str = "pipeline",
    chunk: int = 256,
    max_bytes: float = MAX_BYTES,
) -> Plan:
    """The slicing of one microbatch of `batch` sequences that minimizes the
    objective; never worse than `best_uniform` (which the lockstep search
    includes, and which the pipeline DP covers exactly).

    `granularity` None: `auto_granularity(seq_len)`. Memory: the cost table
    and the DP's arrays, about `plan_bytes` (checked against `max_bytes`
    before anything is allocated); time: units^2 work per candidate bound."""
    _check(stages=stages, objective=objective)
    granularity = auto_granularity(seq_len) if granularity is None else granularity
    n = _units(seq_len, granularity)
    _check_memory(seq_len, granularity, chunk, 1, max_bytes)
    table = _cost_table(n, granularity, cost, batch)
    best = _Best()
    seen = {}
    for tmax, s_end, choice in _dp_chunks(table, n, stages, chunk, best):
        totals = s_end + (stages - 1) * tmax
        if objective == "pipeline":
            j = int(np.argmin(totals))
            if totals[j] < best.latency:
                best.latency, best.units = float(totals[j]), _backtrack(choice[j], n)
        else:
            for j in np.flatnonzero(np.isfinite(totals)):
                s = _backtrack(choice[j], n)
                if s not in seen:
                    seen[s] = None
                    best.latency = min(best.latency, float(totals[j]))
    if objective == "pipeline":
        slices = tuple(u * granularity for u in best.units)
        return Plan(slices, latency(slices, cost, stages, batch), objective, batch)
    candidates = [tuple(u * granularity for u in s) for s in seen]
    plans = [
        Plan(s, latency(s, cost, stages, batch, objective), objective, batch) for s in candidates
    ]
    plans.append(best_uniform(seq_len, stages, cost, granularity, batch, objective))
    return min(plans, key=lambda p: p.latency)


def plan_batch(
    batch: int,
    seq_len: int,
    stages: int,
    cost: Cost,
    granularity: int | None = None,
    chunk: int = 256,
    max_bytes: float = MAX_BYTES,
) -> BatchPlan:
    """Joint batch x token plan (pipeline objective): split `batch` sequences
    into microbatches, each with its own token slicing, minimizing
    sum of all slice times + (K - 1) * the longest slice time. Memory: one
    cost table per microbatch size (`plan_bytes`)."""
    _check(stages=stages, objective="pipeline")
    if not isinstance(batch, int) or batch <= 0:
        raise UsageError(f"batch must be a positive int, got {batch!r}")
    granularity = auto_granularity(seq_len) if granularity is None else granularity
    n = _units(seq_len, granularity)
    _check_memory(seq_len, granularity, chunk, batch, max_bytes)
    tables = {b: _cost_table(n, granularity, cost, b) for b in range(1, batch + 1)}
    best = _Best()
    for tmax in _bound_chunks(_bounds(list(tables.values()), n), stages, chunk, best):
        runs = {b: _dp(tables[b], n, tmax) for b in tables}
        f = np.full((len(tmax), batch + 1), np.inf)
        f[:, 0] = 0.0
        pick = np.zeros((len(tmax), batch + 1), np.int64)
        for total in range(1, batch + 1):
            for b in range(1, total + 1):
                v = f[:, total - b] + runs[b][0]
                better = v < f[:, total]
                f[:, total] = np.where(better, v, f[:, total])
                pick[:, total] = np.where(better, b, pick[:, total])
        totals = f[:, batch] + (stages - 1) * tmax
        j = int(np.argmin(totals))
        if totals[j] < best.latency:
            micro, rest = [], batch
            while rest:
                b = int(pick[j, rest])
                micro.append((b, tuple(u * granularity for u in _backtrack(runs[b][1][j], n))))
                rest -= b
            best.latency, best.units = float(totals[j]), tuple(reversed(micro))
    times = np.concatenate([slice_times(s, cost, b) for b, s in best.units])
    return BatchPlan(best.units, float(times.sum() + (stages - 1) * times.max()))


def brute_force(
    seq_len: int,
    stages: int,
    cost: Cost,
    granularity: int = 1,
    batch: int = 1,
    objective: str = "pipeline",
) -> Plan:
    """Every slicing (2^(n-1) of them): for tests on short sequences."""
    n = _units(seq_len, granularity)
    if n > 16:
        raise UsageError(f"brute force over {n} units is too slow; use at most 16")
    best = None
    for mask in range(1 << (n - 1)):
        cuts = [i + 1 for i in range(n - 1) if mask >> i & 1]
        units = np.diff([0, *cuts, n])
        s = tuple(int(u) * granularity for u in units)
        p = Plan(s, latency(s, cost, stages, batch, objective), objective, batch)
        if best is None or p.latency < best.latency:
            best = p
    return best


# -- the dynamic program -------------------------------------------------------


def _cost_table(n: int, g: int, cost: Cost, batch: int) -> np.ndarray:
    """table[k, j]: time of a slice of k units after j units of context (inf
    where k + j > n or k = 0)."""
    k, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = (k >= 1) & (k + j <= n)
    t = np.asarray(cost(batch, np.maximum(k, 1) * g, j * g), np.float64)
    t = np.broadcast_to(t, k.shape)
    if np.any(valid & ~(t >= 0)):
        raise UsageError("the cost model returned a negative or NaN slice time")
    return np.where(valid, t, np.inf)


def _dp(table: np.ndarray, n: int, tmax: np.ndarray):
    """For each bound in `tmax` (C,): S(n) (C,) and the chosen last-slice
    length at every position (C, n + 1)."""
    c = len(tmax)
    s = np.full((c, n + 1), np.inf)
    s[:, 0] = 0.0
    choice = np.zeros((c, n + 1), np.int64)
    for i in range(1, n + 1):
        ks = np.arange(1, i + 1)
        t = table[ks, i - ks]  # (i,) cost of the last slice [i - k, i)
        vals = s[:, i - ks] + t
        vals = np.where(t[None, :] <= tmax[:, None], vals, np.inf)
        best = np.argmin(vals, axis=1)
        s[:, i] = vals[np.arange(c), best]
        choice[:, i] = ks[best]
    return s[:, n], choice


@dataclasses.dataclass
class _Best:
    """The best plan found so far (`units`: slice units, or microbatches)."""

    latency: float = np.inf
    units: tuple = ()


def _bounds(tables: list[np.ndarray], n: int) -> np.ndarray:
    """Every distinct slice time that can bound the longest slice, cheapest
    first. The last slice of a sequence ends at unit n: no bound below the
    cheapest such slice (over all `tables`) admits a plan."""
    values = np.unique(np.concatenate([t[np.isfinite(t)] for t in tables]))
    ks = np.arange(1, n + 1)
    floor = min(float(np.min(t[ks, n - ks])) for t in tables)
    return values[values >= floor]


def _bound_chunks(values: np.ndarray, stages: int, chunk: int, best: _Best):
    """`values` in chunks of `chunk` bounds, stopping once (K - 1) x the
    smallest bound alone reaches the best latency found so far (TeraPipe's
    early stop: every later bound is larger). With one stage the bound costs
    nothing, so the loosest bound alone gives the optimum: one DP."""
    if stages == 1:
        yield values[-1:]
        return
    for start in range(0, len(values), chunk):
        tmax = values[start : start + chunk]
        if (stages - 1) * tmax[0] >= best.latency:
            return
        yield tmax


def _dp_chunks(table, n, stages, chunk, best: _Best):
    for tmax in _bound_chunks(_bounds([table], n), stages, chunk, best):
        s_end, choice = _dp(table, n, tmax)
        yield tmax, s_end, choice


def _backtrack(choice: np.ndarray, n: int) -> tuple[int, ...]:
    units, i = [], n
    while i > 0:
        k = int(choice[i])
        units.append(k)
        i -= k
    return tuple(reversed(units))


def _units(seq_len: int, granularity: int) -> int:
    for name, v in (("seq_len", seq_len), ("granularity", granularity)):
        if not isinstance(v, int | np.integer) or v <= 0:
            raise UsageError(f"{name} must be a positive int, got {v!r}")
    if seq_len % granularity:
        raise UsageError(
            f"seq_len={seq_len} is not a multiple of granularity={granularity}; "
            "choose a granularity that divides it"
        )
    return seq_len // granularity


def _check(stages: int, objective: str) -> None:
    if not isinstance(stages, int | np.integer) or stages <= 0:
        raise UsageError(f"stages must be a positive int, got {stages!r}")
    if objective not in OBJECTIVES:
        raise UsageError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def folded(slices) -> str:
    """Slice lengths with repeats folded: 16x8, 4x16."""
    out, i = [], 0
    while i < len(slices):
        j = i
        while j < len(slices) and slices[j] == slices[i]:
            j += 1
        out.append(f"{j - i}x{slices[i]}" if j - i > 1 else str(slices[i]))
        i = j
    return ", ".join(out)
