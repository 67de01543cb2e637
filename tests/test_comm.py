import json

import optax
import pytest
from flax import nnx

from zpp_jax import GPT, GPTConfig, Trainer, nnx_parts, quant
from zpp_jax.cli import main
from zpp_jax.comm import DEFAULT_CONFIGS, step_report

CFG = GPTConfig.preset("tiny", seq_len=16)
SCALARS = 256  # loss mean and gradient-norm all-reduces of a few fp32 scalars


def _report(mesh, name):
    trainer = Trainer(
        nnx_parts(GPT(CFG, nnx.Rngs(0))), optax.adamw(1e-3), mesh, DEFAULT_CONFIGS[name]
    )
    return trainer, step_report(trainer, name, 16, CFG.seq_len)


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
    layers, s = trainer.num_layers, trainer.layouts["blocks"].shard_size
    # per block: forward gather, backward gather, reduce-scatter, each moving
    # (N-1)/N of the bf16 vector of N*s elements
    assert _in_loop(r, layers, True) == layers * 3 * (n - 1) / n * n * s * 2
    assert r["intra_node_bytes"] == 0
    # embedding and head add at most the same three each, plus a few scalars
    rest = sum(3 * (n - 1) * trainer.layouts[g].shard_size * 2 for g in ("embed", "head"))
    assert r["cross_node_bytes"] <= _in_loop(r, layers, True) + rest + SCALARS


def test_zeropp_matches_the_analytic_count(mesh):
    nodes, local = mesh.devices.shape
    n = nodes * local
    trainer, r = _report(mesh, "zeropp")
    layers, s = trainer.num_layers, trainer.layouts["blocks"].shard_size
    w8, w4 = quant.wire_bytes(s, 8, 256), quant.wire_bytes(s, 4, 64)
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
