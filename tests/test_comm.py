import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zpp_jax import Trainer, quant
from zpp_jax.analysis import step_report
from zpp_jax.cli import main
from zpp_jax.cli.comm import DEFAULT_CONFIGS
from zpp_jax.mesh import shard_dim
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.partition import call_layout

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
    assert r["estimate"] is None  # XLA:CPU has no latency-hiding scheduler
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
    cross += (nodes - 1) / nodes * nodes * w4  # qgZ permutes across nodes
    intra = 2 * (local - 1) / local * n * w8  # forward and backward gathers in the node
    intra += (local - 1) / local * n * w4  # qgZ all-to-all inside the node
    assert _in_loop(r, layers, True) == layers * cross
    assert _in_loop(r, layers, False) == layers * intra
    kinds = {(c["kind"], c["spans_nodes"]) for c in r["collectives"]}
    assert ("all-gather", False) in kinds and ("collective-permute", True) in kinds
    # The layers' collectives are named by the region of the layer they run in.
    regions = {c["kind"]: c["region"] for c in r["collectives"] if c["runs"] == layers}
    assert regions == {
        "all-gather": "gather",
        "all-to-all": "reduce",
        "collective-permute": "reduce",
    }


@pytest.mark.slow  # compiles five configurations' steps
def test_cli_json(capsys):
    assert main(["comm", "--json", "--configs", "zero3", "zeropp", "jit", "--seq", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in out["configs"]]
    assert names == ["zero3", "zeropp", "jit"]
    z3, zpp, jit = out["configs"]
    assert zpp["cross_node_bytes"] * 4 <= z3["cross_node_bytes"]
    assert jit["config"] == {"baseline": "jit"} and z3["config"]["quantize_weights"] is False
    for c in out["configs"]:
        assert c["peak_memory_bytes"] > 0 and c["collectives"]
        assert {"kind", "dtypes", "bytes", "replica_groups", "runs", "spans_nodes"} <= set(
            c["collectives"][0]
        )
    capsys.readouterr()
    assert main(["comm", "--configs"]) == 2  # argparse: one line, status 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "zpp comm: error: argument --configs: expected at least one argument"
    ]


_SCHEDULED = """\
HloModule m, is_scheduled=true

%gemm_computation (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (param: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %param = (s32[], bf16[64,64]{1,0}) parameter(0)
  %x = bf16[64,64]{1,0} get-tuple-element(%param), index=1
  %i = s32[] get-tuple-element(%param), index=0
  %ag = (u16[8,64]{1,0}, u16[64,64]{1,0}) all-gather-start(%y), ALL8, dimensions={0}, ASYNC
  %gemm = bf16[64,64]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_computation, DOT
  %agd = u16[64,64]{1,0} all-gather-done(%ag)
  %a2a = ((u8[8,32]{1,0}), u8[8,32]{1,0}) all-to-all-start(%gemm), NODE4, dimensions={0}, ASYNC
  %add = bf16[64,64]{1,0} add(%x, %x)
  %a2ad = u8[8,32]{1,0} all-to-all-done(%a2a)
  ROOT %t = (s32[], bf16[64,64]{1,0}) tuple(%i, %gemm)
}

%cond (param: (s32[], bf16[64,64])) -> pred[] {
  %param = (s32[], bf16[64,64]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %w = (s32[], bf16[64,64]{1,0}) while(%init), condition=%cond, body=%body, TRIP6
  %ar = f32[] all-reduce-start(%w), ALL8, to_apply=%add, SYNC
  %ard = f32[] all-reduce-done(%ar)
  ROOT %r = bf16[64,64]{1,0} get-tuple-element(%w), index=1
}
"""
# Long attributes as XLA prints them, spelled once.
for _key, _text in {
    "ALL8": "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}",
    "NODE4": "channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}",
    "ASYNC": 'backend_config={"collective_backend_config":{"is_sync":false}}',
    "SYNC": 'backend_config={"collective_backend_config":{"is_sync":true}}',
    "DOT": 'metadata={op_name="jit(step)/layer/dot_general"}',
    "TRIP6": 'backend_config={"known_trip_count":{"n":"6"}}',
}.items():
    _SCHEDULED = _SCHEDULED.replace(_key, _text)


def test_schedule_overlap_reads_what_runs_behind_each_collective():
    from zpp_jax.analysis import (
        collectives_in_hlo,
        overlap_by_kind,
        schedule_overlap,
        unhideable_by_kind,
    )

    scheduled = {s.name: s for s in schedule_overlap(_SCHEDULED)}
    assert scheduled["ag"].behind == ("jit(step)/layer/dot_general",)
    assert scheduled["ag"].runs == 6 and scheduled["ag"].is_async
    assert scheduled["a2a"].behind == ()  # only an add between start and done
    assert not scheduled["ar"].is_async  # XLA made it synchronous
    # What some schedule could hide: the all-gather is independent of the
    # iteration's matrix multiply; the all-to-all reduces its result, and
    # the all-reduce that of the loop, the program's only one.
    assert {n: s.hideable for n, s in scheduled.items()} == {"ag": True, "a2a": False, "ar": False}
    assert unhideable_by_kind(list(scheduled.values())) == {
        "all-gather": 0,
        "all-to-all": 6,
        "all-reduce": 1,
    }
    assert overlap_by_kind(list(scheduled.values())) == {
        "all-gather": (6, 6),
        "all-to-all": (0, 6),
        "all-reduce": (0, 1),
    }
    # an async start's shape is (operands, results): the bytes are the results'
    sizes = {c.name: c.result_bytes for c in collectives_in_hlo(_SCHEDULED)}
    assert sizes == {"ag": 64 * 64 * 2, "a2a": 8 * 32, "ar": 4}


# The end of a schedule dump (``xla_dump_latency_hiding_schedule``) as
# XLA writes it: statistics in scheduler cycles, zeros left out.
_SCHEDULE_DUMP = """\
  instructions {
    id: 25769803779
    start_timestamp_cycles: 19.992
    end_timestamp_cycles: 19.992
  }
  scheduler_statistics {
    all_to_all_wasted_cycles: 30
    collective_permute_wasted_cycles: 10.5
    total_wasted_cycles: 40.5
    total_cycles: 400
    memory_pressure_peak: 4194304
  }
  cycles_per_microsecond: 2
}
"""


def test_schedule_estimate_reads_the_schedulers_statistics():
    from zpp_jax.analysis import schedule_estimate

    est = schedule_estimate(_SCHEDULE_DUMP)
    assert est.step_us == 200.0  # 400 cycles at 2 per microsecond
    assert est.exposed_us == {
        "all-gather": 0.0,
        "all-to-all": 15.0,
        "reduce-scatter": 0.0,
        "all-reduce": 0.0,
        "collective-permute": 5.25,
    }
    assert est.exposed_total_us == 20.25
    assert schedule_estimate(_SCHEDULED) is None  # an HLO text, no statistics


@pytest.mark.parametrize(
    "groups,want",
    [
        ("mesh['stage'=2,'local'=4] {'local'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['stage'=2,'local'=4] {'stage'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", (tuple(range(8)),)),
        ("mesh['a'=2,'b'=2,'c'=2] {'a','c'}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ],
)
def test_mesh_axes_replica_groups_are_read(groups, want):
    """XLA's partitioner writes a collective's groups as mesh axes and the
    axes a group spans; each group is the devices that differ only there."""
    from zpp_jax.analysis import collectives_in_hlo

    line = (
        f"  %ag = f32[8,4]{{1,0}} all-gather(%p), channel_id=1, replica_groups={groups}, dims={{0}}"
    )
    (c,) = collectives_in_hlo(line)
    assert c.groups == want
    assert c.moved_bytes == 8 * 4 * 4 * (len(want[0]) - 1) / len(want[0])
