"""`zpp tune`: choose the ZeRO++ settings for one model, mesh, batch and link.

1. **Candidates** (`candidates`): ZeRO-3; each technique alone; all three
   with weight bits 8 or 4 and gradient bits 4 or 8; with error feedback
   (degree 1 only); each at every tensor-parallel degree of ``--tp``.
   The fastest eligible one (5.) is then refined (`refinements`): other weight and
   gradient block sizes, the other recomputation policies, small
   parameters kept whole.
2. **Pruning** (`link_bound_s`): each candidate's bytes per device per step
   across and inside nodes follow from the parameter count and its wire
   format (the ring model); at the link's rates they take a time no step of
   that candidate can beat. A candidate whose bound is above the fastest
   eligible step measured so far (5.) is not compiled. Candidates are measured in the
   order of their bounds, so the likely winners come first.
3. **Measuring**: on CPU devices each step is compiled once and timed
   (median of ``steps`` after ``warmup``), in one process or under
   `jax.distributed` over a real link (process 0's times, shared so that
   every process prunes and chooses alike). The ``confirm`` fastest
   eligible steps are kept compiled and, once the search ends, timed
   again side by side, one step of each in turn, so that settings a few
   percent apart are told apart under the same load. On the GPU target
   the step is compiled (not run) and XLA's estimate of it, with the link
   model, is what counts. ``budget`` bounds the compiles; the
   confirmation compiles nothing more.
4. **Numerics** (`tune_run.Tuner.gradient_error`), as each candidate is measured: the
   relative error of its gradient against the exact one (ZeRO-3 on an fp32
   wire) on one real batch, ‖g - g_exact‖ / ‖g_exact‖ over all parameters,
   once per distinct quantization. On the GPU target it is measured on CPU
   devices with the architecture's ``tiny`` preset.
5. The winner, the fastest candidate whose gradient error is within
   ``max_grad_error`` (on CPU devices: of those timed side by side), is
   written with `ZeroPPConfig.to_file`, for ``zpp train --config``.

Importing this module costs no JAX.
"""

from __future__ import annotations

import dataclasses
import math

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import Number, UsageError, count
from zpp_jax.fields import check_flags, option
from zpp_jax.recipes.config import ARCHS, DTYPES, check_degree

TARGETS = ("cpu", "h200")


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """What `zpp tune` tunes for, and how much it may spend; its fields are
    the command's flags."""

    arch: str = option("gpt", "the model family", choices=ARCHS)
    model: str = option("tiny", "size preset: tiny, small (both), 125m (gpt), 7b, 70b (llama)")
    entry: str | None = option(
        None,
        "MODULE:FUNCTION returning an NNX model that maps (batch, seq) token ids to "
        "logits, instead of --arch/--model (ids are bytes: its vocabulary must be >= 256)",
    )
    seq_len: int | None = option(
        None, "sequence length (default: the preset's)", type=count(), name="--seq"
    )
    nodes: int = option(2, "nodes; under zpp launch, the job's process count", type=count())
    local: int = option(4, "devices per node; under zpp launch, each process's", type=count())
    tp: str = option(
        "1",
        "tensor-parallel degrees to search, e.g. 1,2,4, or all (each that divides --local "
        "and the model's heads): each splits a node's --local devices into groups of that "
        "many, which split every layer, ZeRO++ over the groups",
    )
    batch: int = option(16, "global batch (sequences)", type=count())
    compute_dtype: str = option("bfloat16", "dtype the model computes in", choices=DTYPES)
    link: str | None = option(
        None,
        "the links, to prune and (on the GPU target) to schedule with: "
        "intra=GB/s,inter=GB/s[,latency=us] per device, or the file zpp profile --link wrote",
    )
    target: str = option(
        "cpu",
        "cpu: time the steps here; h200: compile for H200s, rank by XLA's estimate",
        choices=TARGETS,
    )
    target_config: str | None = option(
        None, "the GPU target description (.txtpb); default: $ZPP_GPU_TARGET_CONFIG"
    )
    budget: int = option(24, "compile at most this many candidates", type=count())
    steps: int = option(5, "timed steps per candidate (cpu)", type=count())
    warmup: int = option(1, "untimed steps first (cpu)", type=count(0))
    confirm: int = option(
        3,
        "before choosing, time this many of the fastest eligible settings again, side by "
        "side, one step of each in turn (cpu; 0 or 1: choose on the search's times)",
        type=count(0),
    )
    max_grad_error: float = option(
        0.25,
        "choose only settings whose gradient's relative error is at most this: the default "
        "admits ZeRO++'s published setting (int8 weights, int4 gradients) and refuses int4 "
        "weights, whose gradient is wrong by about its own size; raise it to admit them",
        type=Number(float, 0, why="a relative error"),
    )
    out: str = option("zpp_tuned.json", "write the winner's ZeroPPConfig here")
    overwrite: bool = option(False, "replace --out if it exists")
    progress: bool = option(True, "no progress bar on stderr", name="--quiet", negate=True)

    def __post_init__(self) -> None:
        check_flags(self)
        if self.entry is not None and ":" not in self.entry:
            raise UsageError(f"--entry {self.entry!r}: give MODULE:FUNCTION")
        devices = self.nodes * self.local
        if self.batch % devices:
            fits = -(-self.batch // devices) * devices
            raise UsageError(
                f"global batch {self.batch} must be a multiple of the {devices} devices "
                f"(--nodes {self.nodes} x --local {self.local}): use --batch {fits}, or "
                "another mesh"
            )
        if self.link is not None:
            Link.parse(self.link)
        self.degrees()

    def degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees --tp names, each checked against
        --local (every divisor of --local for ``all``; the model's heads are
        checked once it is built)."""
        if self.tp == "all":
            return tuple(t for t in range(1, self.local + 1) if self.local % t == 0)
        try:
            degrees = tuple(sorted({int(t) for t in self.tp.split(",")}))
        except ValueError:
            raise UsageError(f"--tp {self.tp!r}: give degrees such as 1,2,4, or all") from None
        if not degrees or degrees[0] < 1:
            raise UsageError(f"--tp {self.tp!r}: each degree must be a positive number")
        for t in degrees:
            check_degree(t, self.local)
        return degrees


@dataclasses.dataclass(frozen=True)
class Link:
    """The links a step's bytes cross, GB/s each device sends: inside a
    node (`intra_gbps`) and to other nodes (`inter_gbps`), and the fixed
    cost of one collective (`latency_us`)."""

    intra_gbps: float
    inter_gbps: float
    latency_us: float = 25.0

    @classmethod
    def parse(cls, text: str) -> Link:
        """``intra=GB/s,inter=GB/s[,latency=us]``, or the JSON file
        ``zpp profile --link`` writes (its measured link is the one between
        nodes; inside a node the default `LinkModel`'s rate is assumed)."""
        import json
        import pathlib

        if "=" not in text:
            try:
                measured = json.loads(pathlib.Path(text).read_text())
                inter = measured["bytes_per_s"] / 1e9
                latency = measured["latency_s"] * 1e6
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise UsageError(
                    f"--link {text!r}: not intra=GB/s,inter=GB/s[,latency=us] and not a file "
                    f"zpp profile --link wrote ({e})"
                ) from None
            return cls(intra_gbps=max(inter, 400.0), inter_gbps=inter, latency_us=latency)
        return cls._parse_numbers(text)

    @classmethod
    def _parse_numbers(cls, text: str) -> Link:
        names = {"intra": "intra_gbps", "inter": "inter_gbps", "latency": "latency_us"}
        values = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            if key.strip() not in names:
                raise UsageError(f"--link {text!r}: unknown {key!r}; use intra=, inter=, latency=")
            try:
                number = float(value)
            except ValueError:
                raise UsageError(f"--link {text!r}: {key}={value!r} is not a number") from None
            if not math.isfinite(number) or number <= 0:
                raise UsageError(f"--link {text!r}: {key} must be a positive number")
            values[names[key.strip()]] = number
        missing = [k for k, v in names.items() if v not in values and k != "latency"]
        if missing:
            raise UsageError(f"--link {text!r}: give {' and '.join(f'{k}=' for k in missing)}")
        return cls(**values)

    def link_model(self):
        """The same links as the engine's `LinkModel` (for XLA's scheduler)."""
        from zpp_jax.overlap import LinkModel

        return LinkModel(self.intra_gbps, self.inter_gbps, self.latency_us)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting: a name a reader can parse, its configuration, and the
    tensor-parallel degree it runs at."""

    name: str
    config: ZeroPPConfig
    tp: int = 1

    @property
    def label(self) -> str:
        """The name with its degree (none at 1): unique across degrees."""
        return self.name if self.tp == 1 else f"{self.name}, tp {self.tp}"


def candidates(base: ZeroPPConfig, tp: int = 1) -> list[Candidate]:
    """ZeRO-3, each technique alone, and all three at each pair of bit
    widths, plus error feedback (at degree 1: it does not yet combine with
    tensor parallelism): `base` (its wire dtype, remat, blocks) with the
    techniques switched, at tensor-parallel degree `tp`."""
    out = _techniques(base)
    if tp > 1:
        out = [c for c in out if not c.config.error_feedback]
    return [dataclasses.replace(c, tp=tp) for c in out]


def _techniques(base: ZeroPPConfig) -> list[Candidate]:
    off = dict(quantize_weights=False, hpz=False, quantize_gradients=False)
    out = [
        Candidate("zero3", base.replace(**off, error_feedback=False)),
        Candidate("hpz", base.replace(**{**off, "hpz": True}, error_feedback=False)),
    ]
    for bits in (8, 4):
        cfg = base.replace(**{**off, "quantize_weights": True}, weight_bits=bits)
        out.append(Candidate(f"qwz{bits}", cfg.replace(error_feedback=False)))
        cfg = base.replace(**{**off, "quantize_gradients": True}, gradient_bits=bits)
        out.append(Candidate(f"qgz{bits}", cfg))
    on = dict(quantize_weights=True, hpz=True, quantize_gradients=True)
    for w in (8, 4):
        for g in (4, 8):
            cfg = base.replace(**on, weight_bits=w, gradient_bits=g, error_feedback=False)
            out.append(Candidate(f"zeropp w{w} g{g}", cfg))
    out.append(
        Candidate(
            "zeropp w8 g4 ef",
            base.replace(**on, weight_bits=8, gradient_bits=4, error_feedback=True),
        )
    )
    return out


def refinements(best: Candidate) -> list[Candidate]:
    """Variations of the fastest setting: block sizes of what it quantizes,
    the other recomputation policies, parameters under 100,000 elements
    kept whole."""
    cfg, out = best.config, []
    if cfg.quantize_weights:
        for block in (128, 512):
            if block != cfg.block_size:
                out.append(Candidate(f"{best.name} block {block}", cfg.replace(block_size=block)))
    if cfg.quantize_gradients:
        for block in (64, 128):
            if block != cfg.grad_block:
                name = f"{best.name} gblock {block}"
                out.append(Candidate(name, cfg.replace(gradient_block_size=block)))
    for remat in ("dots", "none", "full"):
        if remat != cfg.remat:
            out.append(Candidate(f"{best.name} remat {remat}", cfg.replace(remat=remat)))
    if cfg.persistence_threshold == 0:
        name = f"{best.name} keep <1e5 whole"
        out.append(Candidate(name, cfg.replace(persistence_threshold=100_000)))
    return [dataclasses.replace(c, tp=best.tp) for c in out]


def wire_bytes(config: ZeroPPConfig, params: int, nodes: int, local: int) -> tuple[float, float]:
    """(Across nodes, inside nodes): the bytes one device must send per step
    for `params` parameters under `config`, by the ring model: each weight
    gathered once for the forward pass and each gradient reduced once. A
    lower bound of what the compiled step moves: most units gather their
    weights again for the backward pass (not an embedding, whose gradient
    needs no weight; inside the node only, with hpZ), small tensors travel
    unquantized, and the optimizer's own reductions are not counted."""
    n = nodes * local
    raw = 4.0 if config.comm_dtype in (None, "float32") else 2.0
    weight = raw
    if config.quantize_weights:
        weight = config.weight_bits / 8 + 4 / config.block_size
    grad = raw
    if config.quantize_gradients:
        scale = 2 if config.gradient_scale_dtype == "bfloat16" else 4
        grad = config.gradient_bits / 8 + scale / config.grad_block
    if config.hpz:  # over the nodes first (1/local of the weight), then inside
        cross = weight * params * (nodes - 1) / n
        intra = weight * params * (local - 1) / local
    else:
        cross, intra = weight * params * (n - 1) / n, 0.0
    if config.quantize_gradients:  # inside the node, then 1/local of it across
        intra += grad * params * (local - 1) / local
        cross += grad * params / local * (nodes - 1) / nodes
    else:
        cross += grad * params * (n - 1) / n
    if nodes == 1:  # every group is inside the one node
        cross, intra = 0.0, cross + intra
    return cross, intra


def link_bound_s(
    config: ZeroPPConfig, params: int, nodes: int, local: int, link: Link, tp: int = 1
) -> float:
    """Seconds the step's `wire_bytes` take on `link`, the two kinds of link
    in parallel: no step of `config` can be faster. At a tensor-parallel
    degree `tp` each of a node's `local` / `tp` data devices sends its
    rank's 1/tp of the parameters (the model axis's own activation traffic,
    which only adds, is not counted)."""
    cross, intra = wire_bytes(config, params / tp, nodes, local // tp)
    return max(cross / (link.inter_gbps * 1e9), intra / (link.intra_gbps * 1e9))


def numerics_key(config: ZeroPPConfig) -> tuple:
    """What decides a setting's first gradient: its quantization. hpZ,
    recomputation, error feedback (whose residual starts at zero) and
    persistence change how, not what, is computed."""
    weights = (config.weight_bits, config.block_size) if config.quantize_weights else None
    grads = None
    if config.quantize_gradients:
        grads = (
            config.gradient_bits,
            config.grad_block,
            config.gradient_rounding,
            config.gradient_scale_dtype,
        )
    return weights, grads, None if weights and grads else config.comm_dtype


def within_error(error: float | None, max_grad_error: float | None) -> bool:
    """Whether a setting's gradient error `error` is within `max_grad_error`
    (any, if None; an error that could not be measured, None, counts as
    within)."""
    return max_grad_error is None or error is None or error <= max_grad_error


def measured_rows(rows: list[dict]) -> list[dict]:
    """The rows with a measured step that fits in a device's memory."""
    return [r for r in rows if r.get("step_s") is not None and r.get("fits", True)]


def choose(rows: list[dict], max_grad_error: float | None) -> dict:
    """The fastest measured row whose gradient error is `within_error`
    `max_grad_error`; among those timed again side by side
    (``confirmed``), if any were."""
    measured = measured_rows(rows)
    if any(r.get("confirmed") for r in measured):
        measured = [r for r in measured if r.get("confirmed")]
    if not measured:
        if any(r.get("fits") is False for r in rows):
            raise UsageError(
                "no measured setting fits in a GPU's memory: search higher --tp degrees, "
                "more devices, or a shorter --seq"
            )
        raise UsageError("no candidate was measured: raise --budget")
    allowed = [r for r in measured if within_error(r.get("grad_error"), max_grad_error)]
    if not allowed:
        errors = [r for r in rows if r.get("grad_error") is not None]
        least = min(errors, key=lambda r: r["grad_error"], default=None)
        smallest = (
            f"; the smallest measured is {least['grad_error']:.3g} ({least['name']}): raise "
            "it to at least that"
            if least
            else ": raise it, or the --budget"
        )
        raise UsageError(
            f"no setting's gradient error is within --max-grad-error {max_grad_error}{smallest}"
        )
    return min(allowed, key=lambda r: r["step_s"])
