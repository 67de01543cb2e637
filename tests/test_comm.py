import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zpp_jax import Trainer, quant, step_report
from zpp_jax.cli import main
from zpp_jax.cli.comm import DEFAULT_CONFIGS
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.unit import call_layout, shard_dim

CFG = GPTConfig.preset("tiny", seq_len=16)
SCALARS = 256  # loss mean and gradient-norm all-reduces of a few fp32 scalars


def _report(mesh, name):
    trainer = Trainer(GPT(CFG, nnx.Rngs(0)), optax.adamw(1e-3), mesh, DEFAULT_CONFIGS[name])
    tokens = jax.ShapeDtypeStruct((16, CFG.seq_len), jnp.int32)
    return trainer, step_report(trainer, {"inputs": tokens, "targets": tokens})


def _layout(module, config, n, stacked=False):
    """The per-device layout of one call of a unit (one layer of a stack):
    its parameters, each split along its own dimension."""
    lead = 1 if stacked else 0
    params = []
    for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        shape = np.shape(v.get_value())[lead:]
        params.append((shape, jnp.float32, shard_dim(shape, n, False)))
    return call_layout(config, params, n)


def _shard_size(module, config, n, stacked=False):
    return _layout(module, config, n, stacked).shard_size


def _in_loop(report, layers, spans_nodes):
    """Bytes per step of the collectives inside the scanned block loop."""
    return sum(
        c["moved_bytes"] * c["runs"]
        for c in report["collectives"]
        if c["runs"] == layers and c["spans_nodes"] == spans_nodes
    )


def test_zero3_matches_the_analytic_count(mesh):
    nodes, local = mesh.devices.shape
    n = nodes * local
    trainer, r = _report(mesh, "zero3")
    model, cfg = GPT(CFG, nnx.Rngs(0)), DEFAULT_CONFIGS["zero3"]
    layers, s = CFG.n_layers, _shard_size(model.blocks, cfg, n, stacked=True)
    # per block: forward gather, backward gather, reduce-scatter, each moving
    # (N-1)/N of the bf16 vector of N*s elements
    assert _in_loop(r, layers, True) == layers * 3 * (n - 1) / n * n * s * 2
    assert r["intra_node_bytes"] == 0
    # embedding and head add at most the same three each, plus a few scalars
    rest = sum(3 * (n - 1) * _shard_size(m, cfg, n) * 2 for m in (model.embed, model.head))
    assert r["cross_node_bytes"] <= _in_loop(r, layers, True) + rest + SCALARS


def test_zeropp_matches_the_analytic_count(mesh):
    nodes, local = mesh.devices.shape
    n = nodes * local
    trainer, r = _report(mesh, "zeropp")
    model = GPT(CFG, nnx.Rngs(0))
    layout = _layout(model.blocks, DEFAULT_CONFIGS["zeropp"], n, stacked=True)
    # weights: each segment (the run of whole 256-blocks, then every other
    # tensor's block) quantized on its own, its padding not sent; gradients:
    # the whole per-device vector in 32-blocks with bf16 scales
    w8 = sum(quant.wire_bytes(k, 8, 256) for _, k in layout.segments)
    w4 = quant.wire_bytes(layout.shard_size, 4, 32, scale_bytes=2)
    layers = CFG.n_layers
    # hpZ gathers the int8 forward weight over `node` (the secondary shard),
    # then over `local`; the backward gathers over `local` only.
    cross = (nodes - 1) / nodes * nodes * w8  # forward gather across nodes
    cross += (nodes - 1) / nodes * nodes * w4  # qgZ all-to-all across nodes
    intra = 2 * (local - 1) / local * n * w8  # forward and backward gathers in the node
    intra += (local - 1) / local * n * w4  # qgZ all-to-all inside the node
    assert _in_loop(r, layers, True) == layers * cross
    assert _in_loop(r, layers, False) == layers * intra
    kinds = {(c["kind"], c["spans_nodes"]) for c in r["collectives"]}
    assert ("all-gather", False) in kinds and ("all-to-all", True) in kinds


def test_cli_json(capsys):
    assert main(["comm", "--json", "--configs", "zero3", "zeropp", "--seq", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in out["configs"]]
    assert names == ["zero3", "zeropp"]
    z3, zpp = out["configs"]
    assert zpp["cross_node_bytes"] * 4 <= z3["cross_node_bytes"]
    for c in out["configs"]:
        assert c["peak_memory_bytes"] > 0 and c["collectives"]
        assert {"kind", "dtypes", "bytes", "replica_groups", "runs", "spans_nodes"} <= set(
            c["collectives"][0]
        )
    with pytest.raises(SystemExit):
        main(["comm", "--configs"])
