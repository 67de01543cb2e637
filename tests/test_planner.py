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


def test_cost_models_round_trip_and_plan_from_file(tmp_path, capsys):
    import json

    from zpp_jax.pipeline import load_cost, save_cost

    for model in (ATTN, FIT):
        save_cost(model, tmp_path / "cost.json")
        again = load_cost(tmp_path / "cost.json")
        assert again == model
        assert np.allclose(again(2, [8, 16], [0, 32]), model(2, [8, 16], [0, 32]))
    args = ["plan", "--layers", "4", "--hidden", "64", "--seq", "96", "--stages", "2"]
    assert main([*args, "--cost", str(tmp_path / "cost.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost"]["kind"] == "fitted" and sum(out["plan"]["slices"]) == 96
    assert out["plan"]["latency_s"] <= out["uniform"]["latency_s"] * (1 + 1e-12)
    assert out["plan"]["latency_s"] <= out["no_slicing"]["latency_s"]
    (tmp_path / "bad.json").write_text('{"kind": "magic"}')
    with pytest.raises(ValueError, match="unknown cost model kind"):
        load_cost(tmp_path / "bad.json")
    assert main([*args, "--cost", str(tmp_path / "missing.json")]) == 2
