"""`zpp tune`: the candidates, the byte bound that prunes them, the link
and config files, and a whole run choosing the fastest setting it measured."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from zpp_jax import UsageError, ZeroPPConfig
from zpp_jax.analysis import step_report
from zpp_jax.cli import build_parser
from zpp_jax.models import GPT, GPTConfig
from zpp_jax.recipes.tune import (
    Candidate,
    Link,
    TuneConfig,
    candidates,
    choose,
    link_bound_s,
    refinements,
    wire_bytes,
)
from zpp_jax.train import Trainer


def test_candidates_switch_each_technique_alone_and_together():
    found = {c.name: c.config for c in candidates(ZeroPPConfig(comm_dtype="bfloat16"))}
    assert found["zero3"] == ZeroPPConfig.zero3()
    assert found["hpz"] == ZeroPPConfig.zero3(hpz=True)
    alone = {n: (c.quantize_weights, c.hpz, c.quantize_gradients) for n, c in found.items()}
    assert alone["qwz8"] == alone["qwz4"] == (True, False, False)
    assert alone["qgz4"] == alone["qgz8"] == (False, False, True)
    for w in (8, 4):
        for g in (4, 8):
            cfg = found[f"zeropp w{w} g{g}"]
            assert (cfg.weight_bits, cfg.gradient_bits, cfg.hpz) == (w, g, True)
    assert found["zeropp w8 g4 ef"].error_feedback
    more = refinements(Candidate("zeropp w8 g4", found["zeropp w8 g4"]))
    assert {c.config.block_size for c in more} == {128, 256, 512}
    assert {c.config.remat for c in more} == {"dots", "none", "full"}
    assert len({c.name for c in more}) == len(more)


def test_candidates_at_a_tensor_parallel_degree_carry_it_and_leave_out_error_feedback():
    base = ZeroPPConfig(comm_dtype="bfloat16")
    flat, split = candidates(base), candidates(base, tp=2)
    assert [c.name for c in split] == [c.name for c in flat if not c.config.error_feedback]
    assert {c.tp for c in split} == {2} and split[0].label == "zero3, tp 2"
    more = refinements(split[-1])
    assert {c.tp for c in more} == {2} and all(c.label.endswith(", tp 2") for c in more)


def test_tune_reads_the_degrees_and_refuses_those_that_do_not_divide_a_node():
    assert TuneConfig(tp="4,1,2").degrees() == (1, 2, 4)
    assert TuneConfig(tp="all", local=8, batch=16).degrees() == (1, 2, 4, 8)
    with pytest.raises(UsageError, match="--tp 3 must divide --local 4"):
        TuneConfig(tp="1,3")
    with pytest.raises(UsageError, match=r"--tp 'two': give degrees such as 1,2,4, or all"):
        TuneConfig(tp="two")
    from zpp_jax.recipes.tune_run import searched_degrees

    with pytest.raises(UsageError, match="3 does not divide the model's 32 query and 32 key"):
        searched_degrees(TuneConfig(arch="llama", model="7b", tp="3", local=6, batch=12))
    # the tiny Llama's 4 query and 2 key-value heads: 4 is left out of all
    assert searched_degrees(TuneConfig(arch="llama", tp="all")) == (1, 2)


def test_the_link_bound_at_a_degree_is_a_rank_s_share_over_its_data_devices():
    """ZeRO-3's flat ring sends half as much across nodes at degree 2; ZeRO++'s
    hierarchy sends the same (a device's 1/local share of the model either
    way): its gain from the degree is inside the node."""
    link = Link(intra_gbps=100, inter_gbps=1)
    for config in (ZeroPPConfig.zero3(), ZeroPPConfig()):
        at_two = link_bound_s(config, 1_000_000, 2, 4, link, tp=2)
        assert at_two == link_bound_s(config, 500_000, 2, 2, link)
    flat = [wire_bytes(ZeroPPConfig.zero3(), p, 2, q)[0] for p, q in ((1e6, 4), (5e5, 2))]
    assert flat[1] == pytest.approx(flat[0] * (3 / 4) / (7 / 8) / 2)
    ours = [wire_bytes(ZeroPPConfig(), p, 2, q) for p, q in ((1e6, 4), (5e5, 2))]
    assert ours[1][0] == pytest.approx(ours[0][0]) and ours[1][1] < ours[0][1]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("zero3", marks=pytest.mark.slow),
        "hpz",
        pytest.param("zeropp w8 g4", marks=pytest.mark.slow),
    ],
)
def test_wire_bytes_bound_what_the_compiled_step_moves(mesh24, name):
    """The analytic bytes are a lower bound of the compiled step's (which
    re-gathers most weights for the backward pass, across nodes without
    hpZ), and within 2x of them: the pruning is sound and useful. A flat
    gather, a hierarchical one, and quantized weights and gradients."""
    cfg = GPTConfig.preset("tiny", seq_len=16, dtype="float32")
    config = {c.name: c.config for c in candidates(ZeroPPConfig(comm_dtype="bfloat16"))}[name]
    model = GPT(cfg, nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    trainer = Trainer(model, optax.adamw(1e-3), mesh24, config)
    tokens = jax.ShapeDtypeStruct((8, cfg.seq_len), jnp.int32)
    report = step_report(trainer, {"inputs": tokens, "targets": tokens})
    cross, intra = wire_bytes(config, params, 2, 4)
    assert cross <= report["cross_node_bytes"] <= 2 * cross
    assert intra <= report["intra_node_bytes"] <= 2 * intra + 1


def test_link_bound_is_the_slower_link_and_orders_the_techniques():
    slow = Link(intra_gbps=100, inter_gbps=0.025)  # 200 Mbit/s between nodes
    bounds = {
        c.name: link_bound_s(c.config, 10**8, 2, 4, slow)
        for c in candidates(ZeroPPConfig(comm_dtype="bfloat16"))
    }
    cross, _ = wire_bytes(ZeroPPConfig.zero3(), 10**8, 2, 4)
    assert bounds["zero3"] == pytest.approx(cross / 0.025e9)
    assert bounds["zeropp w4 g4"] < bounds["zeropp w8 g4"] < bounds["qwz8"] < bounds["zero3"]
    one_node = wire_bytes(ZeroPPConfig.zero3(), 10**8, 1, 8)
    assert one_node[0] == 0 and one_node[1] > 0


def test_link_parses_numbers_and_profile_files(tmp_path):
    assert Link.parse("intra=300,inter=50") == Link(300, 50, 25.0)
    assert Link.parse("inter=1.25,intra=100,latency=40") == Link(100, 1.25, 40.0)
    measured = tmp_path / "link.json"
    measured.write_text(json.dumps({"bytes_per_s": 1.25e9, "latency_s": 3e-4}))
    got = Link.parse(str(measured))
    assert got.inter_gbps == pytest.approx(1.25) and got.latency_us == pytest.approx(300)
    for bad, why in [
        ("intra=300", "give inter="),
        ("intra=300,inter=-1", "positive"),
        ("intra=300,inter=x", "not a number"),
        ("up=3,inter=1", "unknown 'up'"),
        (str(tmp_path / "missing.json"), "zpp profile --link"),
    ]:
        with pytest.raises(UsageError, match=why):
            Link.parse(bad)
    with pytest.raises(UsageError, match="MODULE:FUNCTION"):
        TuneConfig(entry="mymodels")
    with pytest.raises(UsageError, match=r"batch 16 must be a multiple of the 9 devices .*18"):
        TuneConfig(nodes=3, local=3)


def test_choose_takes_the_fastest_within_the_error_bound():
    rows = [
        {"name": "a", "step_s": 1.0, "grad_error": 0.5},
        {"name": "b", "step_s": 2.0, "grad_error": 0.01},
        {"name": "c", "step_s": None, "note": "pruned"},
    ]
    assert choose(rows, None)["name"] == "a"
    assert choose(rows, 0.1)["name"] == "b"
    bound = r"--max-grad-error 0.001; the smallest measured is 0.01 \(b\): raise it to at least"
    with pytest.raises(UsageError, match=bound):
        choose(rows, 0.001)
    with pytest.raises(UsageError, match="raise --budget"):
        choose(rows[2:], None)


def test_a_step_over_a_device_s_memory_is_marked_and_never_chosen(tmp_path):
    from zpp_jax.analysis.target import device_memory_bytes
    from zpp_jax.recipes.tune_run import degree_lines, mark_unfit

    spec = tmp_path / "gpu.txtpb"
    spec.write_text("gpu_device_info {\n  device_memory_size: 2000000000\n}\n")
    memory = device_memory_bytes(spec)
    assert memory == 2_000_000_000
    row = dict(exposed_s=0.0, cross_node_bytes=1e6, grad_error=0.01)
    rows = [
        {"name": "zero3", "tp": 1, "step_s": 1.0, "peak_memory_bytes": 3e9, **row},
        {"name": "zero3, tp 2", "tp": 2, "step_s": 1.5, "peak_memory_bytes": 1.5e9, **row},
    ]
    for r in rows:
        mark_unfit(r, memory)
    assert rows[0]["fits"] is False and rows[0]["note"] == "does not fit: peak 3.0 GB > 2.0 GB"
    assert "fits" not in rows[1]
    assert choose(rows, 0.25)["name"] == "zero3, tp 2"
    with pytest.raises(UsageError, match="no measured setting fits in a GPU's memory"):
        choose(rows[:1], 0.25)
    why = degree_lines({"rows": rows, "winner": "zero3, tp 2", "tp": 2})
    assert why[1].startswith("  tp 1: zero3 1000.0 ms, peak 3.000 GB, does not fit")
    assert why[2].startswith("  tp 2: zero3, tp 2 1500.0 ms") and why[2].endswith("<- chosen")


def test_choose_takes_the_fastest_of_the_settings_timed_side_by_side():
    rows = [
        {"name": "a", "step_s": 1.0, "grad_error": 0.01},  # its search time, lucky
        {"name": "b", "step_s": 1.2, "search_step_s": 1.1, "confirmed": True},
        {"name": "c", "step_s": 1.1, "search_step_s": 1.05, "confirmed": True},
    ]
    assert choose(rows, 0.25)["name"] == "c"
    assert choose(rows[:1], 0.25)["name"] == "a"


def test_the_table_ranks_the_measured_and_says_why_the_rest_were_not():
    from zpp_jax.recipes.tune_run import table

    row = dict(exposed_s=0.0, cross_node_bytes=1e6, peak_memory_bytes=1e9, grad_error=0.12)
    note = "not compiled: gradient error 1.07e+00 > --max-grad-error 0.25"
    rows = [
        {"name": "w8 g8", "step_s": 1.0, **row},
        {"name": "w8 g4", "step_s": 2.0, **row},
        {"name": "w4 g4", "note": note, "grad_error": 1.07},
    ]
    text = table({"rows": rows, "winner": "w8 g4"}, "cpu").splitlines()
    assert text[1].startswith(" 1 w8 g8") and text[2].startswith(" * w8 g4")
    assert text[3].split() == ["w4", "g4", *note.split()]
    assert TuneConfig().max_grad_error == 0.25


def test_config_file_round_trips_and_refuses_what_it_cannot_read(tmp_path):
    path = tmp_path / "zpp.json"
    config = ZeroPPConfig(weight_bits=4, gradient_block_size=64, remat="full")
    config.to_file(path, about={"setting": "w4"})
    assert ZeroPPConfig.from_file(path) == config
    with pytest.raises(UsageError, match="overwrite"):
        config.to_file(path)
    body = json.loads(path.read_text())
    body["ZeroPPConfig"]["colour"] = "red"
    path.write_text(json.dumps(body))
    with pytest.raises(UsageError, match=r"unknown ZeroPPConfig fields \['colour'\]"):
        ZeroPPConfig.from_file(path)
    path.write_text("[]")
    with pytest.raises(UsageError, match="holds no"):
        ZeroPPConfig.from_file(path)
    with pytest.raises(UsageError, match="remat function"):
        ZeroPPConfig(remat=lambda *a, **k: False).to_file(tmp_path / "f.json")


def test_zpp_train_starts_from_a_config_file(tmp_path):
    from zpp_jax.cli import _run_config

    path = tmp_path / "tuned.json"
    ZeroPPConfig(comm_dtype="bfloat16", weight_bits=4, block_size=128).to_file(path)
    args = build_parser().parse_args(["train", "--config", str(path), "--no-hpz"])
    cfg, _ = _run_config(args)
    assert cfg.zero == ZeroPPConfig(comm_dtype="bfloat16", weight_bits=4, block_size=128, hpz=False)
    args = build_parser().parse_args(["train", "--config", str(path), "--zero3"])
    with pytest.raises(UsageError, match="drop one"):
        _run_config(args)


@pytest.mark.slow
def test_zpp_tune_writes_the_fastest_setting_it_measured(tmp_path):
    """Over tensor-parallel degrees 1 and 2, with a budget of 2 compiles:
    ZeRO++'s setting at each degree (their bounds tie), ranked, the
    fastest written with its degree, and why that degree, by line."""
    out = tmp_path / "tuned.json"
    cmd = [sys.executable, "-m", "zpp_jax", "tune", "--model", "tiny", "--seq", "16"]
    cmd += ["--batch", "8", "--budget", "2", "--steps", "2", "--quiet", "--out", str(out)]
    cmd += ["--link", "intra=100,inter=0.025", "--tp", "1,2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    measured = [line for line in lines if line[:2].strip() == "*" or line[:2].strip().isdigit()]
    assert len(measured) == 2  # the budget
    assert {line.split("  ")[0][3:] for line in measured} == {"zeropp w8 g4", "zeropp w8 g4, tp 2"}
    assert sum("not compiled: --budget spent" in line for line in lines) >= 9
    chosen = json.loads(out.read_text())["about"]
    winner = [line for line in measured if line.startswith(" *")]
    assert len(winner) == 1 and chosen["setting"] in winner[0]
    tp = chosen["tp"]
    assert (", tp 2" in chosen["setting"]) == (tp == 2)
    why = lines[lines.index("by tensor-parallel degree (the fastest measured of each):") + 1 :]
    assert [line.split(":")[0] for line in why[:2]] == ["  tp 1", "  tp 2"]
    assert why[tp - 1].endswith("<- chosen") and not why[2 - tp].endswith("<- chosen")
    assert why[2].endswith(f"train it with: zpp train --config {out}" + " --tp 2" * (tp == 2))
    steps = [float(line.split(" ms")[0].split()[-1]) for line in measured]
    assert steps[0] == min(steps)  # the table is ranked and the winner is first
    assert ZeroPPConfig.from_file(out).quantize_gradients
    # Both fit --confirm's default 3: each was timed again, side by side.
    rows = chosen["rows"]
    assert sum(bool(r.get("confirmed")) for r in rows) == 2
    assert all(r["search_step_s"] > 0 for r in rows if r.get("confirmed"))
    # No gradient is spent on a setting the budget leaves out.
    spent = [r for r in rows if r.get("note") == "not compiled: --budget spent"]
    assert len(spent) >= 9 and not any("grad_error" in r for r in spent)
    assert "(the first 2 timed again side by side, and chosen among)" in lines
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "--overwrite" in again.stderr
