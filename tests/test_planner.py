import dataclasses
import json

import numpy as np
import pytest

from zpp_jax.cli import main
from zpp_jax.pipeline import (
    AnalyticCost,
    FittedCost,
    best_uniform,
    brute_force,
    latency,
    plan_batch,
    plan_tokens,
    uniform_slicing,
)

# Context-heavy costs (long sequences, narrow model), where equal slices are
# unbalanced and the best slicing is not uniform.
ATTN = AnalyticCost(hidden=64, layers=2, flops=1e9, overhead_s=5e-3, saturation_tokens=1)
FIT = FittedCost(
    layers=3, base_lengths=(1, 8, 64), base_times=(1e-4, 1.5e-4, 6e-4), coef=(1e-6, 2e-6, 3e-7)
)


@pytest.mark.parametrize("cost", [ATTN, FIT, AnalyticCost(hidden=512, layers=4)])
@pytest.mark.parametrize("stages", [1, 2, 3, 8])
@pytest.mark.parametrize("objective", ["pipeline", "lockstep"])
def test_planner_equals_brute_force(cost, stages, objective):
    seq, g = 96, 8  # 12 units: 2048 slicings
    p = plan_tokens(seq, stages, cost, granularity=g, objective=objective)
    b = brute_force(seq, stages, cost, granularity=g, objective=objective)
    assert sum(p.slices) == seq and all(s % g == 0 for s in p.slices)
    assert p.latency == pytest.approx(latency(p.slices, cost, stages, objective=objective))
    if objective == "pipeline":  # exact DP
        assert p.latency == pytest.approx(b.latency, rel=1e-12)
    else:  # a search over the DP's solutions and the uniform slicings
        assert p.latency <= best_uniform(seq, stages, cost, g, objective=objective).latency
        assert p.latency <= 1.05 * b.latency


def test_brute_force_with_granularity_one():
    p = plan_tokens(13, 4, FIT, granularity=1)
    assert p.latency == pytest.approx(brute_force(13, 4, FIT).latency, rel=1e-12)


def test_never_worse_than_uniform_and_non_uniform_when_context_costs():
    for stages in (2, 4, 8):
        p = plan_tokens(512, stages, ATTN, granularity=8)
        u = best_uniform(512, stages, ATTN, granularity=8)
        assert p.latency <= u.latency * (1 + 1e-12)
    p = plan_tokens(512, 4, ATTN, granularity=8)
    assert len(set(p.slices)) > 1 and p.slices[0] > p.slices[-1]  # later slices shorter
    # strictly better than every uniform slicing, by more than float round-off
    assert p.latency < best_uniform(512, 4, ATTN, granularity=8).latency * (1 - 1e-9)


def test_latency_objectives_by_hand():
    def cost(batch, length, context):
        return batch * (np.asarray(length) + 0.5 * np.asarray(context))

    # slices 4, 2: t = 4, 2 + 2 = 4 -> pipeline 8 + (K-1) * 4
    assert latency((4, 2), cost, 3) == pytest.approx(8 + 2 * 4)
    # lockstep, K=2: steps {s0}, {s0, s1}, {s1}; s1 padded to 4 when beside s0.
    # step costs: 4; max(4, 4 + 2) = 6; 2 + 2 = 4 -> 14
    assert latency((4, 2), cost, 2, objective="lockstep") == pytest.approx(14)
    assert uniform_slicing(10, 3) == (4, 3, 3)


def test_plan_batch_matches_token_plan_for_one_sequence_and_splits_a_batch():
    one = plan_batch(1, 96, 4, ATTN, granularity=8)
    assert one.latency == pytest.approx(plan_tokens(96, 4, ATTN, granularity=8).latency)
    both = plan_batch(4, 96, 4, ATTN, granularity=8)
    assert sum(b for b, _ in both.microbatches) == 4
    assert all(sum(s) == 96 for _, s in both.microbatches)
    # No worse than running the 4 sequences as one microbatch, sliced optimally.
    assert both.latency <= plan_tokens(96, 4, ATTN, granularity=8, batch=4).latency * (1 + 1e-12)


def test_gpt3_175b_plan(capsys):
    # How long it takes is benchmarks/planner.py's to report.
    assert (
        main(["plan", "--layers", "96", "--hidden", "12288", "--seq", "2048", "--stages", "48"])
        == 0
    )
    out = capsys.readouterr().out
    assert "planner" in out and "uniform" in out and "no slicing" in out


def test_bad_input():
    with pytest.raises(ValueError, match="multiple of granularity"):
        plan_tokens(100, 2, ATTN, granularity=8)
    with pytest.raises(ValueError, match="stages"):
        plan_tokens(96, 0, ATTN)
    with pytest.raises(ValueError, match="objective"):
        plan_tokens(96, 2, ATTN, objective="fast")
    with pytest.raises(ValueError, match="hidden"):
        AnalyticCost(hidden=0, layers=1)
    with pytest.raises(ValueError, match="matmul_weights"):
        AnalyticCost(hidden=8, layers=1, matmul_weights=-1)


def test_analytic_cost_counts_the_given_matmul_weights():
    """The dense term is 2 x tokens x weights (x 3 for the backward pass):
    a GPT block's 4h^2 + 2hf by default, or the count given (a Llama's)."""
    gpt = AnalyticCost(hidden=64, layers=1, ffn=256, flops=1.0, overhead_s=0, saturation_tokens=1)
    same = dataclasses.replace(gpt, matmul_weights=4 * 64 * 64 + 2 * 64 * 256)
    assert same(1, 8, 0) == gpt(1, 8, 0)
    double = dataclasses.replace(gpt, matmul_weights=2 * (4 * 64 * 64 + 2 * 64 * 256))
    attention = gpt(1, 8, 0) - 3 * 2 * 8 * (4 * 64 * 64 + 2 * 64 * 256)
    assert double(1, 8, 0) - gpt(1, 8, 0) == pytest.approx(gpt(1, 8, 0) - attention)


def test_cost_models_round_trip_and_plan_from_file(tmp_path, capsys):
    import json

    from zpp_jax.pipeline import load_cost, save_cost

    for model in (ATTN, FIT):
        save_cost(model, tmp_path / "cost.json")
        again = load_cost(tmp_path / "cost.json")
        assert again == model
        assert np.allclose(again(2, [8, 16], [0, 32]), model(2, [8, 16], [0, 32]))
    args = ["plan", "--seq", "96", "--stages", "2"]
    assert main([*args, "--cost", str(tmp_path / "cost.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost"]["kind"] == "fitted" and sum(out["plan"]["slices"]) == 96
    assert out["plan"]["latency_s"] <= out["uniform"]["latency_s"] * (1 + 1e-12)
    assert out["plan"]["latency_s"] <= out["no_slicing"]["latency_s"]
    (tmp_path / "bad.json").write_text('{"kind": "magic"}')
    with pytest.raises(ValueError, match="unknown cost model kind"):
        load_cost(tmp_path / "bad.json")
    assert main([*args, "--cost", str(tmp_path / "missing.json")]) == 2


def test_one_stage_plans_with_one_dp(monkeypatch):
    """K = 1: the bound on a slice costs nothing, so the loosest bound gives
    the optimum; the planner runs the DP once and finds brute force's plan."""
    from zpp_jax.pipeline import planner

    calls = []
    dp = planner._dp
    monkeypatch.setattr(planner, "_dp", lambda *a: calls.append(1) or dp(*a))
    got = plan_tokens(96, 1, ATTN, granularity=8)
    assert len(calls) == 1
    assert got.latency == pytest.approx(brute_force(96, 1, ATTN, granularity=8).latency)


def test_auto_granularity_bounds_the_units_and_long_sequences_plan(capsys):
    from zpp_jax.pipeline.planner import auto_granularity, plan_bytes

    assert auto_granularity(2048) == 8 and auto_granularity(131072) == 512
    assert auto_granularity(100) == 1 and auto_granularity(257) == 257
    for seq in (32768, 131072):
        args = ["plan", "--layers", "96", "--hidden", "12288", "--seq", str(seq)]
        assert main([*args, "--stages", "48", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["granularity"] == seq // 256 and sum(out["plan"]["slices"]) == seq
    # At granularity 1, 131,072 units would need a 128 GiB table: refused up front.
    assert plan_bytes(131072, 1) > 100 * 2**30
    with pytest.raises(
        ValueError, match=r"needs about \d+\.\d GiB.*coarser granularity \(e\.g\. 512"
    ):
        plan_tokens(131072, 48, ATTN, granularity=1)


def test_link_term_adds_each_slice_transfer_and_coarsens_the_plan(tmp_path):
    from zpp_jax.pipeline import load_cost, save_cost
    from zpp_jax.pipeline.cost import LinkCost

    link = LinkCost(ATTN, hidden=64, bytes_per_s=1e6, latency_s=0.01, value_bytes=4)
    # forward activations and backward gradients: 2 x (latency + bytes / bandwidth)
    want = ATTN(2, 8, 16) + 2 * (0.01 + 2 * 8 * 64 * 4 / 1e6)
    assert link(2, 8, 16) == pytest.approx(want)
    save_cost(link, tmp_path / "link.json")
    assert load_cost(tmp_path / "link.json") == link
    without = plan_tokens(96, 4, ATTN, granularity=8)
    with_link = plan_tokens(96, 4, link, granularity=8)
    assert len(with_link.slices) < len(without.slices)
    assert with_link.latency == pytest.approx(brute_force(96, 4, link, granularity=8).latency)


def test_joint_batch_plan_from_the_cli(capsys):
    args = ["plan", "--layers", "40", "--hidden", "5120", "--seq", "256", "--stages", "8"]
    assert main([*args, "--batch", "3", "--granularity", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(b for b, _ in out["plan"]["microbatches"]) == 3
    assert out["plan"]["latency_s"] <= out["one_microbatch"]["latency_s"] * (1 + 1e-12)


@pytest.mark.parametrize(
    "extra, content, message",
    [
        (["--stages", "5"], None, "--stages 5 is more than the 4 layers"),
        (["--hidden", "32"], "fit", "models hidden 64, not --hidden 32"),
        (
            ["--layers", "8"],
            "fit",
            "models 2 layers per stage, but --layers 8 on --stages 2 gives 4",
        ),
        ([], "[1, 2, 3]", "a cost model is a JSON object"),
        (
            [],
            '{"kind": "fitted", "layers": 2, "base_lengths": [1, 8], "base_times": [1, 2], '
            '"coef": [1, 2]}',
            "coef must be 3 finite numbers",
        ),
        (
            [],
            '{"kind": "fitted", "layers": 2, "base_lengths": [1, 8], "base_times": [1, 2], '
            '"coef": {"a": 1}}',
            "coef must be 3 finite numbers",
        ),
        (
            [],
            '{"kind": "fitted", "layers": 2, "base_lengths": [1, 8], "base_times": [-1, 2], '
            '"coef": [0, 0, 0]}',
            "base_times must be finite numbers >= 0",
        ),
        (["--batch", "2", "--objective", "lockstep"], None, "drop --objective lockstep"),
        (["--link-latency-us", "5"], None, "--link-gbps must be a positive bandwidth"),
        (["--link-gbps", "1", "--link", "x.json"], None, "drop --link-gbps"),
    ],
)
def test_bad_plan_input_is_refused_up_front(tmp_path, capsys, extra, content, message):
    args = ["plan", "--seq", "96", "--stages", "2"]
    if content is None:
        args += ["--layers", "4", "--hidden", "64"]
    else:
        path = tmp_path / "cost.json"
        if content == "fit":
            from zpp_jax.pipeline import save_cost

            save_cost(AnalyticCost(hidden=64, layers=2), path)
        else:
            path.write_text(content)
        args += ["--cost", str(path)]
    assert main([*args, *extra]) == 2
    assert message in capsys.readouterr().err
