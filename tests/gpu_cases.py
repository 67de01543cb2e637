"""The steps the GPU-schedule checks compile for 2 x 4 H200 GPUs, and the
record of each one's schedule that `gpu_baselines/overlap.json` keeps.

Shared by `test_gpu_aot.py` and `gpu_baselines/regenerate.py`. Uses only
the package's top-level API.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zpp_jax as zpp
from zpp_jax.models import GPT, GPTConfig, Llama, LlamaConfig

MODELS = {
    # name: (config, global batch); one sequence per device
    "gpt-125m": (GPTConfig.preset("125m"), 8),
    "llama-7b": (LlamaConfig.preset("7b", seq_len=2048), 8),
}
# The same GPT at depths the engine was not tuned on (the preset has 18).
DEPTHS = {f"gpt-{n}-layers": (GPTConfig.preset("125m", n_layers=n), 8) for n in (12, 24)}
SIZES = {**MODELS, **DEPTHS}
CONFIGS = {
    "zero3": zpp.ZeroPPConfig.zero3(comm_dtype="bfloat16"),
    "zeropp": zpp.ZeroPPConfig(comm_dtype="bfloat16"),
    "zeropp_ef": zpp.ZeroPPConfig(comm_dtype="bfloat16", error_feedback=True),
}
# The steps whose schedule the baseline keeps: every model and depth with
# every configuration, the GPT's layer loop kept as a loop, and the
# plain-jit baseline.
CASES = (
    [(m, c, True) for m in SIZES for c in CONFIGS]
    + [("gpt-125m", c, False) for c in ("zero3", "zeropp")]
    + [("gpt-125m", "jit", True)]
)


def model(name):
    cfg = SIZES[name][0]
    return (GPT if isinstance(cfg, GPTConfig) else Llama)(cfg, nnx.Rngs(0))


def trainer(name, config, mesh, unroll=True):
    abstract = nnx.eval_shape(lambda: model(name))
    if config == "nocomm":  # the limit: one device's program, nothing exchanged
        return zpp.baseline.NoCommunication(
            abstract, optax.adamw(1e-3), mesh, compute_dtype="bfloat16"
        )
    if config in ("jit", "jit_fsdp"):
        constrain = config == "jit_fsdp"  # activations constrained to the batch axes
        return zpp.baseline.JitFSDP(
            abstract,
            optax.adamw(1e-3),
            mesh,
            compute_dtype="bfloat16",
            constrain_activations=constrain,
        )
    config = CONFIGS[config].replace(unroll_layer_loops=unroll)
    return zpp.Trainer(abstract, optax.adamw(1e-3), mesh, config, compute_dtype="bfloat16")


def batch(name):
    cfg, rows = SIZES[name]
    tokens = jax.ShapeDtypeStruct((rows, cfg.seq_len), jnp.int32)
    return {"inputs": tokens, "targets": tokens}


@functools.cache
def h200():
    return zpp.analysis.target_mesh(2, 4)


@functools.cache
def report(name, config, target="h200", unroll=True):
    mesh = h200() if target == "h200" else zpp.make_mesh(2, 4)
    return zpp.analysis.step_report(trainer(name, config, mesh, unroll), batch(name))


def key(name, config, unroll) -> str:
    return f"{name}/{config}" + ("" if unroll else "/loop")


def schedule_record(rep: dict) -> dict:
    """What a step's schedule is held to: per collective kind, the runs per
    step behind a matrix multiply, all runs, and the runs no schedule can
    hide; and the bytes per device per step across and inside nodes."""
    kinds = {}
    for kind, (behind, runs) in sorted(rep["overlap"].items()):
        kinds[kind] = {
            "behind": behind,
            "runs": runs,
            "unhideable": rep["unhideable"].get(kind, 0),
        }
    return {
        "kinds": kinds,
        "cross_node_bytes": rep["cross_node_bytes"],
        "intra_node_bytes": rep["intra_node_bytes"],
    }
