"""The training step compiled (not run) for 2 x 4 H200 GPUs.

Needs the gpu-aot extra (JAX's CUDA plugin and ptxas) and an XLA GPU target
description in $ZPP_GPU_TARGET_CONFIG; skipped without them, and never part
of the default test command. Run with
``pip install -e ".[gpu-aot,test]"`` and
``ZPP_GPU_TARGET_CONFIG=h200.txtpb pytest -m gpu_aot -n 0``.

The schedule of each step (what its collectives run behind) is held to
the checked-in baseline `gpu_baselines/overlap.json`, which
`gpu_baselines/regenerate.py` writes; the cases are in `gpu_cases.py`.
"""

import json
import os
import pathlib
import re

import gpu_cases as cases
import jax
import pytest
from flax import nnx
from gpu_cases import CASES, CONFIGS, MODELS, SIZES

from zpp_jax import LinkModel
from zpp_jax.analysis import schedule_overlap
from zpp_jax.analysis.target import TARGET_CONFIG_ENV, has_cuda_plugin, target_config
from zpp_jax.cli import main
from zpp_jax.overlap.links import collective_costs

pytestmark = pytest.mark.gpu_aot
if not has_cuda_plugin():
    pytest.skip('needs JAX\'s CUDA plugin: pip install -e ".[gpu-aot]"', allow_module_level=True)
if not os.environ.get(TARGET_CONFIG_ENV):
    pytest.skip(
        f"needs {TARGET_CONFIG_ENV}: an XLA GPU target description", allow_module_level=True
    )
# A compile-only client cannot load programs back from the persistent cache.
# Set at collection, before the session's first compile (JAX reads it once
# per process), and only where these tests run: set on every collection, it
# kept every other test of the session from the cache.
jax.config.update("jax_enable_compilation_cache", False)

BASELINE = pathlib.Path(__file__).resolve().parent / "gpu_baselines" / "overlap.json"


def _device_memory() -> int:
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config()).group(1))


def test_every_kernel_is_compiled_for_sm90(tmp_path):
    """Every Pallas call of the ZeRO++ step (with error feedback: quantize,
    dequantize, and the fused dequantize-sum-quantize) is a Triton kernel of
    the compiled GPU program, lowered to PTX for sm_90a (and from it, by
    ptxas, to the cubin the program embeds): no reference fallback."""
    trainer = cases.trainer("gpt-125m", "zeropp_ef", cases.h200())
    # The kernels' PTX is dumped for the emitters the pattern names.
    dump = {"xla_dump_to": str(tmp_path), "xla_dump_emitter_re": ".*"}
    compiled = trainer.compile_step(cases.batch("gpt-125m"), {**trainer.compiler_options, **dump})
    text = compiled.as_text()
    calls = [
        line for line in text.splitlines() if "/pallas_call" in line and " custom-call(" in line
    ]
    assert calls, "no Pallas call in the step"
    assert all('custom_call_target="__gpu$xla.gpu.triton"' in line for line in calls)
    # Each op dispatches by platform (a `cond` whose branches are the kernel
    # and the reference): only the kernel's branch is left in the program.
    branches = set(re.findall(r"jit\(_\w+\)/cond/(branch_\d+_fun)/", text))
    kernel = set(re.findall(r"jit\(_\w+\)/cond/(branch_\d+_fun)/pallas_call", text))
    assert branches == kernel and len(kernel) == 1, (branches, kernel)
    names = set(re.findall(r'name = "(\w+)"', text))
    assert {"_quantize_kernel", "_dequantize_kernel", "_dsq_kernel"} <= names
    entries = {}
    for ptx in tmp_path.glob("*.ptx"):
        body = ptx.read_text()
        for entry in re.findall(r"\.entry (\w+)\(", body):
            entries[re.sub(r"__\d+$", "", entry)] = ".target sm_90a" in body
    assert names <= set(entries), names - set(entries)
    assert all(entries[n] for n in names)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_collectives_equal_the_cpu_count(config):
    """The GPU program moves what the CPU program moves: per collective
    kind, the same bytes per step across and inside nodes, in the same
    element types (so XLA's own passes, its collective quantizer included,
    changed none of them). XLA:GPU combines and splits collectives
    differently, so instruction counts differ; the scalar all-reduces of
    the loss and the checks are compared by size only."""
    gpu, cpu = cases.report("gpt-125m", config), cases.report("gpt-125m", config, "cpu")

    def by_kind(report):
        out = {}
        for c in report["collectives"]:
            key = (c["kind"], c["spans_nodes"])
            moved, dtypes = out.get(key, (0.0, set()))
            out[key] = (moved + c["moved_bytes"] * c["runs"], dtypes | set(c["dtypes"]))
        return out

    g, c = by_kind(gpu), by_kind(cpu)
    vectors = {k for k in g | c if k[0] != "all-reduce"}
    for key in vectors:
        assert g[key] == c[key], (key, g.get(key), c.get(key))
    scalars = sum(v[0] for k, v in g.items() if k[0] == "all-reduce")
    assert scalars < 64
    assert gpu["cross_node_bytes"] == pytest.approx(cpu["cross_node_bytes"], abs=64)
    assert gpu["intra_node_bytes"] == pytest.approx(cpu["intra_node_bytes"], abs=64)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_and_peak_memory_fit_an_h200(name, config):
    """Per GPU: the state is its analytic size (parameters and both Adam
    moments, 1/8 each; with error feedback also residuals of (1 + 1/local)
    x each unit's whole size, fp32, on every GPU), and the compiled step's
    peak fits in the H200."""
    report = cases.report(name, config)
    params = nnx.state(nnx.eval_shape(lambda: cases.model(name)), nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    analytic = 3 * 4 * n_params / 8
    if CONFIGS[config].error_feedback:
        analytic += 4 * n_params * (1 + 1 / 4)
    assert report["state_bytes"] == pytest.approx(analytic, rel=0.01)
    assert report["state_bytes"] < report["peak_memory_bytes"] < _device_memory()


# The collectives of each role: weight gathers, and gradient reductions
# (a reduce-scatter, or the all-to-alls of a narrow wire and of qgZ, whose
# step across nodes is a permute).
ROLES = {
    "gathers": ("all-gather",),
    "reductions": ("reduce-scatter", "all-to-all", "collective-permute"),
}


def _share(report, kinds, where=None):
    hit = total = 0
    for c in report["collectives"]:
        if c["kind"] in kinds and (where is None or where(c)):
            total += c["runs"]
            hit += c["runs"] * bool(c["behind"])
    return hit / total


def _baseline() -> dict:
    """The record of each case, and the jax version that compiled them."""
    return json.loads(BASELINE.read_text())


@pytest.mark.parametrize("name,config,unroll", CASES, ids=[cases.key(*c) for c in CASES])
def test_the_schedule_is_the_baseline(name, config, unroll):
    """Per collective kind, the runs per step behind a matrix multiply, all
    runs and the runs no schedule can hide, and the bytes across and inside
    nodes, are those of `gpu_baselines/overlap.json`: any change of the
    schedule, a regression or a gain, shows here. A change meant is
    recorded with ``python tests/gpu_baselines/regenerate.py``, which prints
    the difference, and committed with it."""
    baseline = _baseline()
    want = baseline["cases"].get(cases.key(name, config, unroll))
    got = cases.schedule_record(cases.report(name, config, unroll=unroll))
    assert got == want, (
        f"the schedule of {cases.key(name, config, unroll)} changed: {json.dumps(got)}, baseline "
        f"{json.dumps(want)} (made with jax {baseline['jax']}; this is jax {jax.__version__}); "
        "if meant, run tests/gpu_baselines/regenerate.py"
    )


def test_the_baseline_covers_every_case():
    assert set(_baseline()["cases"]) == {cases.key(*c) for c in CASES}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("role", list(ROLES))
def test_collectives_run_behind_matrix_multiplies(name, config, role):
    """On the models the engine is made for, at least 90% of each role's
    collectives per step run behind a matrix multiply (collectives costed
    on the engine's default `LinkModel`)."""
    assert _share(cases.report(name, config), ROLES[role]) >= 0.9


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_xla_estimates_the_step_and_the_communication_it_leaves_exposed(name, config):
    """The scheduler's own estimate (`ScheduleEstimate`): a step time, and
    per collective kind the time no compute covers, less than the step.
    The collectives' transfers queue on one communication stream, so the
    step is never below the time its busiest link is busy, nor below the
    kernels alone."""
    est = cases.report(name, config)["estimate"]
    assert est["step_us"] > 0 and est["queue"] == "stream"
    assert set(est["exposed_us"]) >= {"all-gather", "all-to-all", "collective-permute"}
    assert 0 <= sum(est["exposed_us"].values()) < est["step_us"]
    assert set(est["link_busy_us"]) <= {"nic", "nvlink"} and est["link_busy_us"]
    assert est["step_us"] >= max(est["link_busy_us"].values())
    assert est["step_us"] == pytest.approx(est["compute_us"] + sum(est["exposed_us"].values()))


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("config", ["zeropp", "zeropp_ef"])
def test_zeropp_leaves_at_most_a_tenth_of_the_step_exposed(name, config):
    """In XLA's estimate, with the collectives priced on the default links
    (400 GB/s inside a node, 45 GB/s across), ZeRO++'s communication that no
    kernel covers is at most 10% of the step, with or without error
    feedback, on every model and depth."""
    est = cases.report(name, config)["estimate"]
    assert sum(est["exposed_us"].values()) <= 0.1 * est["step_us"]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("config", ["zeropp", "zeropp_ef"])
def test_zeropp_leaves_less_communication_exposed_than_zero3(name, config):
    """In XLA's estimate, with the collectives costed on the links they
    cross, the ZeRO++ step waits on communication for less time than the
    ZeRO-3 (bf16 wire) step of the same model."""
    zero3 = cases.report(name, "zero3")["estimate"]["exposed_us"]
    zpp = cases.report(name, config)["estimate"]["exposed_us"]
    assert sum(zpp.values()) < sum(zero3.values())


def _unhideable_share(report, kinds):
    runs = [(c["runs"], c["hideable"]) for c in report["collectives"] if c["kind"] in kinds]
    return sum(n for n, ok in runs if not ok) / sum(n for n, _ in runs)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_what_no_schedule_can_hide_bounds_the_overlap(name, config):
    """A collective that every matrix multiply of its computation (the
    program, or one loop iteration) feeds or waits for runs behind none in
    any schedule of the program, and is never counted behind one. With the
    layers relayed (the Llama's list, the GPT's unrolled layer loop) the
    only such reductions are the first layer's: through the relay every
    other unit's reduction, and so every matrix multiply, feeds it, and the
    embedding's backward pass after it has no matrix multiply (one unit of
    the GPT's 20, two collectives of its 40 with qgZ)."""
    report = cases.report(name, config)
    for c in report["collectives"]:
        assert c["hideable"] or not c["behind"], c
    assert _unhideable_share(report, ROLES["reductions"]) <= 0.05


@pytest.mark.parametrize("config", ["zero3", "zeropp"])
def test_a_layer_loop_left_as_a_loop_hides_almost_no_reduction(config):
    """The GPT's `nnx.scan` kept as a loop (``unroll_layer_loops=False``):
    inside an iteration every matrix multiply feeds the layer's reduction,
    so most reductions are unhideable and at most a fifth run behind a
    GEMM; unrolled, the same model's are all hideable (the test above)."""
    report = cases.report("gpt-125m", config, unroll=False)
    assert _unhideable_share(report, ROLES["reductions"]) > 0.5
    assert _share(report, ROLES["reductions"]) < 0.2
    # XLA's statistics would count the loop's body once: no estimate.
    assert report["estimate"] is None and "loop" in report["estimate_withheld"]


def test_the_plain_jit_baseline_compiles_for_the_target():
    """`JitFSDP`, the GPT under plain `jax.jit` with FSDP-style shardings and
    bf16 compute: its step compiles for 2 x 4 H200s with asynchronous
    collectives, the largest weight gather travels in bf16, and its layer
    loop withholds XLA's estimate (counted once, not per layer)."""
    report = cases.report("gpt-125m", "jit")
    gathers = [c for c in report["collectives"] if c["kind"] == "all-gather"]
    assert any(c["async"] for c in report["collectives"])
    assert set(max(gathers, key=lambda c: c["bytes"])["dtypes"]) == {"bf16"}
    assert report["estimate"] is None and "loop" in report["estimate_withheld"]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_relayed_layers_gather_one_layer_ahead(name, config):
    """The units are relayed (`ShardedLayer.relayed`; the GPT's layer loop
    unrolled to do so): each forward gather waits for the previous layer's
    input and runs behind that layer's matrix multiplies. At least 85% do
    (all but the first units', which have nothing before them)."""
    report = cases.report(name, config)
    assert _share(report, ("all-gather",), lambda c: "transpose(" not in c["op"]) >= 0.85


def test_comm_target_h200_prints_the_schedule(capsys):
    assert main(["comm", "--target", "h200", "--configs", "zero3", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "on h200" in out and "overlapped / collectives" in out
    assert re.search(r"all-gather .* behind: \d+ GEMMs, first ", out)
    # beside the step: the kernels alone and each link's busy time
    assert re.search(r"compute alone [\d.]+ ms, (nic|nvlink) busy [\d.]+ ms", out)


def test_scheduled_program_names_every_collective():
    """`schedule_overlap` finds each collective `collectives_in_hlo` counts."""
    from zpp_jax.analysis import collectives_in_hlo

    trainer = cases.trainer("gpt-125m", "zeropp", cases.h200())
    text = trainer.compile_step(cases.batch("gpt-125m")).as_text()
    counted = sorted(c.name for c in collectives_in_hlo(text))
    scheduled = sorted(s.name for s in schedule_overlap(text))
    assert counted == scheduled and counted
    # and the link model prices each of them under the name XLA's
    # scheduler knows it by
    profile = collective_costs(text, 4, LinkModel())
    priced = re.findall(r'name: "([^"]+)"', profile)
    known = set(re.findall(r'scheduling_name="([^"]+)"', text))
    assert len(priced) == len(counted) and set(priced) <= known


def test_the_constrained_jit_baseline_gathers_weights_on_the_target():
    """`JitFSDP(constrain_activations=True)` compiled for the H200s moves
    weights, not activations: all-gathers in bf16 and reductions, no
    all-to-all and no permute."""
    report = cases.report("gpt-125m", "jit_fsdp")
    kinds = {c["kind"] for c in report["collectives"]}
    assert "all-gather" in kinds and not kinds & {"all-to-all", "collective-permute"}, kinds
    gathers = [c for c in report["collectives"] if c["kind"] == "all-gather"]
    assert set(max(gathers, key=lambda c: c["bytes"])["dtypes"]) == {"bf16"}


def test_tune_ranks_by_the_estimate_and_writes_the_winner(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    args = ["tune", "--target", "h200", "--seq", "16", "--batch", "8", "--budget", "2"]
    assert main([*args, "--quiet", "--link", "intra=400,inter=12.5", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "step (XLA's estimate)" in table and "not compiled: --budget spent" in table
    assert re.search(r"compute [\d.]+ ms, (nic|nvlink) [\d.]+ ms", table)
    about = json.loads(out.read_text())["about"]
    measured = [r for r in about["rows"] if "step_s" in r]
    assert len(measured) == 2 and about["step_s"] == min(r["step_s"] for r in measured)
    assert all(r.get("grad_error", 1) < 1 for r in measured)


_AFTER_SCHEDULING = re.compile(
    r"Statistics after scheduling:.*?Total wasted cycles: ([\d.e+]+).*?Total cycles: ([\d.e+]+)",
    re.S,
)


def test_the_estimate_is_xlas_statistics_of_the_schedule_it_made():
    """`ScheduleEstimate` walks the schedule XLA made, as XLA's scheduler
    statistics after scheduling do (which it logs, but does not dump: the
    dump's statistics are of the order before scheduling). With transfers
    unqueued (``queue="none"``), as XLA's statistics count them, the step
    and its exposed time equal those XLA logs for the same compile, to a
    cycle per collective; on one stream (the default) they are longer."""
    import subprocess
    import sys

    script = (
        "import json, pathlib, tempfile, gpu_cases as c\n"
        "from zpp_jax.overlap.links import collective_latencies_us, collective_links\n"
        "from zpp_jax.analysis.schedule import read_estimate\n"
        "t = c.trainer('gpt-12-layers', 'zero3', c.h200())\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    o = {'xla_dump_to': d, 'xla_dump_latency_hiding_schedule': True}\n"
        "    o = {**t.compiler_options, **o}\n"
        "    text = t.compile_step(c.batch('gpt-12-layers'), o).as_text()\n"
        "    lat, links = collective_latencies_us(text, 4, t.links), collective_links(text, 4)\n"
        "    e = [read_estimate(pathlib.Path(d), lat, links, q) for q in ('none', 'stream')]\n"
        "print(json.dumps([[x.step_us, x.exposed_total_us, x.busiest_link_us] for x in e]))\n"
    )
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "0",
        "TF_CPP_VMODULE": "latency_hiding_scheduler=1",
        "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    unqueued, stream = json.loads(done.stdout.strip().splitlines()[-1])
    # The last log is the compile scheduled with the link model's prices.
    wasted, total = map(float, _AFTER_SCHEDULING.findall(done.stderr)[-1])
    assert unqueued[0] == pytest.approx(total, abs=100)
    assert unqueued[1] == pytest.approx(wasted, abs=100)
    # XLA's statistics let every collective run at once: one stream cannot.
    assert stream[0] >= max(unqueued[0], stream[2]) and stream[1] >= unqueued[1]


def test_the_no_communication_limit_is_one_devices_program_with_an_mfu():
    """`NoCommunication` compiled for the H200s: its one collective is the
    gathered losses (4 bytes a device), its layer loop is unrolled (so
    XLA's estimate counts every layer) and its step is its kernels alone,
    below ZeRO-3's. MFU is one device's model FLOPs over the step at the
    H200's dense bfloat16 peak (989 TFLOP/s, from the target description)."""
    from zpp_jax.analysis.report import mfu
    from zpp_jax.cli.comm import device_training_flops

    limit = cases.report("gpt-125m", "nocomm")
    assert [(c["kind"], c["bytes"]) for c in limit["collectives"]] == [("all-gather", 8 * 4)]
    est = limit["estimate"]
    assert est is not None and sum(est["exposed_us"].values()) <= 1e-3 * est["step_us"]
    assert est["step_us"] < cases.report("gpt-125m", "zero3")["estimate"]["step_us"]
    assert est["peak_matrix_flops"] == pytest.approx(989.17e12, rel=1e-4)
    cfg, rows = SIZES["gpt-125m"]
    flops = device_training_flops(nnx.eval_shape(lambda: cases.model("gpt-125m")), 1, cfg.seq_len)
    d, t = cfg.d_model, cfg.seq_len
    per_token = (
        cfg.n_layers * (2 * (4 * d * d + 2 * d * cfg.d_ff) + 4 * t * d) + 2 * d * cfg.vocab_size
    )
    assert flops == 3 * t * per_token  # 0.96 TFLOP
    assert mfu(est, flops) == pytest.approx(flops / (est["step_us"] * 1e-6 * 989.17e12), rel=1e-4)
    assert 0 < mfu(est, flops) < 1


# On 2 x 4 the Llama 7B's quantization passes (the dequantization of each
# gathered layer, the hpZ reorder, qgZ's passes) are 1.10x its step; on
# 2 x 8 and 4 x 8 (benchmarks/gpu_limit.py) it is within 1.05x.
_OVER_THE_LIMIT = pytest.mark.xfail(strict=True, reason="ZeRO++ is 1.10x the limit there")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=_OVER_THE_LIMIT) if n == "llama-7b" else n for n in SIZES]
)
def test_zeropp_is_within_5_percent_of_the_no_communication_step(name):
    """In XLA's estimate, the ZeRO++ step of every model and depth is at
    most 1.05x the step of the same model and per-GPU batch with nothing
    exchanged (one device's program, `NoCommunication`): its communication
    hidden, and its quantization's passes over the weights and gradients
    a few percent of the step."""
    limit = cases.report(name, "nocomm")["estimate"]["step_us"]
    assert cases.report(name, "zeropp")["estimate"]["step_us"] <= 1.05 * limit
