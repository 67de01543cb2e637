import dataclasses
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
from zpp_jax.cli.comm import DEFAULT_CONFIGS, device_training_flops
from zpp_jax.mesh import shard_dim
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.partition import call_layout

CFG = GPTConfig.preset("tiny", seq_len=16)
SCALARS = 256  # loss mean and gradient-norm all-reduces of a few fp32 scalars
# The 4 x 2 mesh's counts follow the same formulas as 2 x 4's: in the slow set.
MESHES = [pytest.param((2, 4), id="2x4"), pytest.param((4, 2), id="4x2", marks=pytest.mark.slow)]


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


@pytest.mark.parametrize("mesh", MESHES, indirect=True)
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


@pytest.mark.parametrize("mesh", MESHES, indirect=True)
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
    configs = ["zero3", "zeropp", "jit", "nocomm"]
    assert main(["comm", "--json", "--configs", *configs, "--seq", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in out["configs"]] == configs
    z3, zpp, jit, limit = out["configs"]
    assert zpp["cross_node_bytes"] * 4 <= z3["cross_node_bytes"]
    assert jit["config"] == {"baseline": "jit"} and z3["config"]["quantize_weights"] is False
    # The limit moves the gathered losses alone and keeps the whole state.
    assert limit["cross_node_bytes"] == 4 * 7 and limit["state_bytes"] > 6 * z3["state_bytes"]
    # One device's model FLOPs, 2 rows of 16 tokens; no MFU without a GPU's peak.
    cfg = GPTConfig.preset("tiny", seq_len=16)
    flops = device_training_flops(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))), 2, 16)
    for c in out["configs"]:
        assert c["model_flops"] == flops and c["mfu"] is None
        assert c["peak_memory_bytes"] > 0 and c["collectives"]
        assert {"kind", "dtypes", "bytes", "replica_groups", "runs", "spans_nodes"} <= set(
            c["collectives"][0]
        )
    capsys.readouterr()
    assert main(["comm", "--configs"]) == 2  # argparse: one line, status 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "zpp comm: error: argument --configs: expected at least one argument"
    ]


@pytest.mark.slow  # compiles two steps
def test_cli_layers_changes_the_depth_not_the_widths(capsys):
    """``--layers`` compiles the preset at another depth: one more layer of
    the tiny GPT adds exactly one layer's parameters (12 d^2 + 13 d, d = 64),
    and the header names the depth."""
    counts = []
    for layers in (2, 3):
        assert main(["comm", "--configs", "zero3", "--seq", "16", "--layers", str(layers)]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert header.startswith(f"gpt tiny, {layers} layers (")
        counts.append(int(header.split("(")[1].split(" ")[0].replace(",", "")))
    assert counts[1] - counts[0] == 12 * 64 * 64 + 13 * 64


@pytest.mark.slow  # two compiles of a whole step
def test_cli_remat_sets_what_the_engine_keeps(capsys):
    """``--remat`` is the engine configurations' recomputation: with "full"
    a unit keeps only its input, so the compiled step's peak is below the
    one that keeps every activation ("none"); the report names it."""
    peaks = {}
    for remat in ("none", "full"):
        assert main(["comm", "--json", "--configs", "zeropp", "--seq", "64", "--remat", remat]) == 0
        (report,) = json.loads(capsys.readouterr().out)["configs"]
        assert report["config"]["remat"] == remat
        peaks[remat] = report["peak_memory_bytes"]
    assert peaks["full"] < peaks["none"]


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
# A schedule dump as XLA writes it (protobuf text): the HLO module's
# instructions, then the schedule with each instruction's time in cycles (2
# per microsecond), then statistics, which are of the order *before*
# scheduling and must be ignored.
_AG_OP = "jit(step)/jvp(zpp_unit[layers/0])/shard_map/zpp_gather/all_gather"
_A2A_OP = "jit(step)/transpose(zpp_unit[layers/1])/shard_map/zpp_reduce/all_to_all"


def _dump_instruction(ident, name, opcode, operand=None, op_name=None, shape="", target=None):
    meta = f'      metadata {{\n        op_name: "{op_name}"\n      }}\n' if op_name else ""
    operand = f"      operand_ids: {operand}\n" if operand else ""
    shape = f"      shape {{\n{shape}      }}\n" if shape else ""
    target = f'      custom_call_target: "{target}"\n' if target else ""
    return (
        f'    instructions {{\n      name: "{name}"\n      opcode: "{opcode}"\n'
        f"{shape}{meta}{target}      id: {ident}\n{operand}    }}\n"
    )


def _array(element_type, *dims, indent=8):
    """A shape's array, as XLA dumps it: with a layout whose tiles have
    dimensions of their own (not the array's)."""
    pad = " " * indent
    lines = [f"{pad}element_type: {element_type}"] + [f"{pad}dimensions: {d}" for d in dims]
    lines += [f"{pad}layout {{", f"{pad}  tiles {{", f"{pad}    dimensions: 128", f"{pad}  }}"]
    return "\n".join([*lines, f"{pad}}}"]) + "\n"


def _timed(ident, start, end):
    return (
        f"  instructions {{\n    id: {ident}\n    start_timestamp_cycles: {start}\n"
        f"    end_timestamp_cycles: {end}\n  }}\n"
    )


def _dump(instructions, timings, statistics=""):
    """A schedule dump of one computation: `instructions` as
    `_dump_instruction`'s arguments, in order, with their (start, end)
    cycles in `timings`, at 2 cycles per microsecond."""
    module = "".join(_dump_instruction(i, *args) for i, args in enumerate(instructions, 1))
    timed = "".join(_timed(i, *t) for i, t in enumerate(timings, 1))
    return (
        'hlo_module {\n  computations {\n    name: "main"\n'
        + module
        + "  }\n}\ncomputation_schedules {\n  computation_id: 1\n"
        + timed
        + statistics
        + "  cycles_per_microsecond: 2\n}\n"
    )


_SCHEDULE_DUMP = _dump(
    [
        ("p", "parameter"),
        ("all-gather-start", "all-gather-start", 1, _AG_OP),
        ("fusion.1", "fusion", 1),
        ("all-gather-done", "all-gather-done", 2, _AG_OP),
        ("all-to-all-start.1", "async-start", 3, _A2A_OP),
        ("all-to-all-done.1", "async-done", 5, _A2A_OP),
        ("fusion.2", "fusion", 6),
    ],
    [(0, 0), (0, 2), (2, 62), (62, 64), (64, 66), (66, 68), (148, 168)],
    "  scheduler_statistics {\n    all_gather_wasted_cycles: 40\n    total_cycles: 500\n  }\n",
)
_LATENCY_US = {"all-gather-start": 20.0, "all-to-all-start.1": 40.0}


def test_schedule_estimate_walks_the_schedule_xla_made():
    """The all-gather's 20 us (40 cycles) run behind the 60-cycle fusion:
    none exposed. The all-to-all's 40 us have 2 cycles of cover, so 78
    cycles (39 us) are exposed, and the step is (2+60+2+2+2+78+20)/2 us.
    The dump's own statistics (of the order before scheduling) are not
    read."""
    from zpp_jax.analysis import schedule_estimate
    from zpp_jax.analysis.report import exposed_time_by_unit

    est = schedule_estimate(_SCHEDULE_DUMP, _LATENCY_US)
    assert est.step_us == 83.0
    assert est.exposed_us == {
        "all-gather": 0.0,
        "all-to-all": 39.0,
        "reduce-scatter": 0.0,
        "all-reduce": 0.0,
        "collective-permute": 0.0,
    }
    assert est.exposed_total_us == 39.0
    assert est.exposed_by_op == {_AG_OP: {"all-gather": 0.0}, _A2A_OP: {"all-to-all": 39.0}}
    by_unit = exposed_time_by_unit(dataclasses.asdict(est))
    assert by_unit == {"layers/1": {"all-to-all reduce": 39.0}}
    # A longer latency is exposed by exactly the difference.
    longer = schedule_estimate(_SCHEDULE_DUMP, {**_LATENCY_US, "all-gather-start": 40.0})
    assert longer.exposed_us["all-gather"] == 9.0  # 80 cycles - 62 of cover, at 2 per us
    assert longer.step_us == 92.0


# Two collectives in flight at once: an all-gather (20 us) and an
# all-to-all (40 us) both started before a 60-cycle fusion.
_TWO_IN_FLIGHT = _dump(
    [
        ("p", "parameter"),
        ("all-gather-start", "all-gather-start", 1, _AG_OP),
        ("all-to-all-start.1", "async-start", 1, _A2A_OP),
        ("fusion.1", "fusion", 1),
        ("all-gather-done", "all-gather-done", 2, _AG_OP),
        ("all-to-all-done.1", "async-done", 3, _A2A_OP),
        ("fusion.2", "fusion", 6),
    ],
    [(0, 0), (0, 2), (2, 4), (4, 64), (64, 66), (66, 68), (68, 88)],
)


def test_collectives_wait_for_the_stream_they_share():
    """One communication stream: the all-to-all's transfer begins when the
    all-gather's ends (cycle 42), ends at 122, and its done (at 68) waits
    54 cycles: 27 us exposed, a step of (88 + 54) / 2 = 71 us. With
    transfers unqueued it would end at 84: 8 us exposed, 52 us. One queue
    per link is the stream when both cross the NIC, and unqueued when they
    cross different links. The compute alone is 88 cycles, 44 us."""
    from zpp_jax.analysis import schedule_estimate

    links = {"all-gather-start": "nvlink", "all-to-all-start.1": "nic"}
    stream = schedule_estimate(_TWO_IN_FLIGHT, _LATENCY_US, links)
    assert stream.queue == "stream" and stream.step_us == 71.0
    assert stream.exposed_us["all-to-all"] == 27.0 and stream.exposed_us["all-gather"] == 0.0
    assert stream.compute_us == 44.0
    assert stream.link_busy_us == {"nvlink": 20.0, "nic": 40.0} and stream.busiest_link_us == 40.0
    unqueued = schedule_estimate(_TWO_IN_FLIGHT, _LATENCY_US, links, queue="none")
    assert unqueued.step_us == 52.0 and unqueued.exposed_total_us == 8.0
    assert schedule_estimate(_TWO_IN_FLIGHT, _LATENCY_US, links, queue="link").step_us == 52.0
    both_nic = dict.fromkeys(links, "nic")
    assert schedule_estimate(_TWO_IN_FLIGHT, _LATENCY_US, both_nic, queue="link").step_us == 71.0
    with pytest.raises(ValueError, match="queue must be one of"):
        schedule_estimate(_TWO_IN_FLIGHT, _LATENCY_US, links, queue="fifo")


@pytest.mark.parametrize("queue", ["stream", "link"])
def test_the_step_is_never_below_its_busiest_link(queue):
    """Both collectives on the NIC, 3x as long: the NIC is busy 180 us. A
    walk that lets them overlap would put the step at 132 us, below the
    time the link needs; a queued walk never does."""
    from zpp_jax.analysis import schedule_estimate

    latency = {name: 3 * us for name, us in _LATENCY_US.items()}
    nic = dict.fromkeys(latency, "nic")
    unqueued = schedule_estimate(_TWO_IN_FLIGHT, latency, nic, queue="none")
    assert unqueued.step_us == 132.0 < unqueued.busiest_link_us == 180.0
    est = schedule_estimate(_TWO_IN_FLIGHT, latency, nic, queue=queue)
    assert est.step_us >= est.busiest_link_us == 180.0
    assert est.step_us == 1 + 180 + 10  # the first start, the two transfers, the last fusion


# A Pallas kernel reading an F32[1024, 256] (1 MiB) and writing its int8
# codes (256 KiB) and one fp32 scale per 32 values (32 KiB): 1,343,488
# bytes. XLA scheduled it at a flat 10 us (20 cycles, 2 per us).
_PALLAS_DUMP = _dump(
    [
        ("p", "parameter", None, None, _array("F32", 1024, 256)),
        (
            "pallas_call.1",
            "custom-call",
            1,
            "jit(step)/zpp_quantize/pallas_call",
            "        element_type: TUPLE\n"
            + "        tuple_shapes {\n"
            + _array("S8", 1024, 256, indent=10)
            + "        }\n        tuple_shapes {\n"
            + _array("F32", 1024, 8, indent=10)
            + "        }\n",
            "__gpu$xla.gpu.triton",
        ),
        ("fusion.1", "fusion", 2),
    ],
    [(0, 0), (0, 20), (20, 40)],
)


def test_a_pallas_kernel_costs_its_bytes_at_the_memory_bandwidth(tmp_path):
    """At 1 TB/s the kernel costs a launch (1 us) and 1.343488 us of
    memory traffic, in place of XLA's flat 10 us; read from a dump, the
    bandwidth is that of the target description XLA wrote beside it."""
    from zpp_jax.analysis import schedule_estimate
    from zpp_jax.analysis.schedule import memory_bandwidth, read_estimate

    flat = schedule_estimate(_PALLAS_DUMP, {})
    assert flat.step_us == 20.0 and flat.pallas_us == 10.0 and flat.pallas_calls == 1
    assert not flat.pallas_from_bytes
    priced = schedule_estimate(_PALLAS_DUMP, {}, memory_bytes_per_s=1e12)
    assert priced.pallas_us == pytest.approx(1 + 1.343488) and priced.pallas_from_bytes
    assert priced.step_us == pytest.approx(priced.compute_us) == pytest.approx(10 + 2.343488)

    (tmp_path / "module_0001.jit_step.schedule.txt").write_text(_PALLAS_DUMP)
    assert memory_bandwidth(tmp_path) is None
    assert read_estimate(tmp_path, {}).pallas_us == 10.0
    config = "gpu_device_info {\n  memory_bandwidth: 1000000000000\n  l2_cache_size: 1\n}\n"
    (tmp_path / "module_0001.jit_step.gpu_target_config.pbtxt").write_text(config)
    assert memory_bandwidth(tmp_path) == 1e12
    assert read_estimate(tmp_path, {}).pallas_us == pytest.approx(2.343488)


def test_schedule_estimate_needs_every_collectives_latency_and_a_schedule():
    from zpp_jax.analysis import schedule_estimate

    assert schedule_estimate(_SCHEDULE_DUMP, {"all-gather-start": 20.0}) is None
    assert schedule_estimate(_SCHEDULED, _LATENCY_US) is None  # an HLO text, no schedule


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
