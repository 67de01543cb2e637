import numpy as np
import pytest

from zpp_jax.cli import main
from zpp_jax.pipeline.cost import load_cost
from zpp_jax.pipeline.profile import fit


def test_fit_recovers_a_known_cost():
    base = {16: 1e-3, 32: 1.5e-3, 64: 2.5e-3}
    coef = (0.0, 3e-7, 4e-9)
    rows = [
        {
            "length": n,
            "context": c,
            "seconds": base[n] + (coef[0] * n + coef[1] * c + coef[2] * n * c if c else 0.0),
        }
        for n in base
        for c in (0, 64, 128, 256)
    ]
    model = fit(rows)
    assert np.allclose(model.coef, coef, rtol=1e-6, atol=1e-12)
    # One slope per length: coef[1] + coef[2] * n seconds per context token.
    assert np.allclose(model.context_slopes, [coef[1] + coef[2] * n for n in base], rtol=1e-9)
    for r in rows:
        assert float(model(1, r["length"], r["context"])) == pytest.approx(r["seconds"], rel=1e-6)
    # Between measured lengths the slope is interpolated: exact for this cost.
    assert float(model(1, 48, 100)) == pytest.approx(2.0e-3 + (3e-7 + 4e-9 * 48) * 100, rel=1e-9)
    with pytest.raises(ValueError, match="at least two lengths"):
        fit([{"length": 8, "context": 0, "seconds": 1.0}])


@pytest.mark.slow  # measures real slices
def test_zpp_profile_writes_a_model_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "cost.json"
    args = [
        "profile",
        "--layers",
        "1",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--lengths",
        "4",
        "8",
        "--contexts",
        "0",
        "8",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    model = load_cost(out)
    assert len(model.base_lengths) == 2 and all(t > 0 for t in model.base_times)
    assert (
        main(
            [
                "plan",
                "--layers",
                "2",
                "--hidden",
                "16",
                "--seq",
                "16",
                "--stages",
                "2",
                "--granularity",
                "4",
                "--cost",
                str(out),
            ]
        )
        == 0
    )
    assert "planner" in capsys.readouterr().out


def test_fitted_cost_never_drops_below_the_no_context_time():
    from zpp_jax.pipeline.cost import FittedCost

    noisy = FittedCost(
        layers=1, base_lengths=(4, 8), base_times=(1e-3, 2e-3), coef=(0.0, -1e-3, 0.0)
    )
    assert float(noisy(1, 4, 100)) == pytest.approx(1e-3)


def test_fitted_cost_is_monotone_in_length_despite_noise():
    from zpp_jax.pipeline.cost import FittedCost

    noisy = FittedCost(layers=1, base_lengths=(4, 8), base_times=(6e-4, 3e-4), coef=(0.0, 0.0, 0.0))
    times = [float(noisy(1, n, 0)) for n in (4, 8, 16, 64)]
    assert times == sorted(times) and min(times) > 0


def test_per_length_slopes_follow_a_cost_the_three_term_fit_cannot():
    # Flat context slope for short slices, steep for long ones (cache effects).
    slope = {64: 2e-5, 128: 2e-5, 512: 2e-4}
    rows = [
        {"length": n, "context": c, "seconds": 1e-4 * n + slope[n] * c}
        for n in slope
        for c in (0, 256, 512, 1024)
    ]
    model = fit(rows)
    worst = max(abs(float(model(1, r["length"], r["context"])) / r["seconds"] - 1) for r in rows)
    assert worst < 1e-9
    from zpp_jax.pipeline.cost import FittedCost

    three_term = FittedCost(
        layers=1, base_lengths=model.base_lengths, base_times=model.base_times, coef=model.coef
    )
    worst3 = max(
        abs(float(three_term(1, r["length"], r["context"])) / r["seconds"] - 1) for r in rows
    )
    assert worst3 > 0.05


def test_step_overhead_calibration_recovers_the_overhead(tmp_path):
    from zpp_jax.pipeline import calibrate_step_overhead, latency, save_cost
    from zpp_jax.pipeline.cost import FittedCost

    cost = FittedCost(
        layers=2, base_lengths=(8, 16), base_times=(1e-3, 1.8e-3), coef=(0.0, 1e-6, 1e-8)
    )
    slices = (8, 8, 16, 8, 8)
    true = FittedCost(**{**cost.__dict__, "step_overhead": 2.5e-4})
    measured = latency(slices, true, 3, objective="lockstep")
    # 7 steps of 2.5e-4 s on top of the stage model.
    assert measured == pytest.approx(latency(slices, cost, 3, objective="lockstep") + 7 * 2.5e-4)
    calibrated = calibrate_step_overhead(cost, slices, 3, measured)
    assert calibrated.step_overhead == pytest.approx(2.5e-4, rel=1e-9)
    # Calibrating again starts from the stage model, not from the last overhead.
    assert calibrate_step_overhead(calibrated, slices, 3, measured).step_overhead == pytest.approx(
        2.5e-4, rel=1e-9
    )
    assert calibrate_step_overhead(cost, slices, 3, measured / 2).step_overhead == 0.0
    save_cost(calibrated, tmp_path / "c.json")
    assert load_cost(tmp_path / "c.json") == calibrated
    with pytest.raises(ValueError, match="positive time"):
        calibrate_step_overhead(cost, slices, 3, 0.0)
    with pytest.raises(ValueError, match="step_overhead"):
        FittedCost(**{**cost.__dict__, "step_overhead": -1.0})
    with pytest.raises(ValueError, match="one slope per base length"):
        FittedCost(**{**cost.__dict__, "context_slopes": (1e-6,)})


@pytest.mark.slow
def test_zpp_profile_link_measures_a_transfer_the_planner_reads(tmp_path, capsys):
    """`zpp profile --link` starts two processes, times point-to-point
    transfers between them and fits latency + bytes / bandwidth; `zpp plan
    --link` adds each slice's transfers with those numbers."""
    import json
    import subprocess
    import sys

    out = tmp_path / "link.json"
    run = subprocess.run(
        # the default 15 timed calls per size: medians that a loaded machine's
        # stalls do not move (with 5, one run measured times that did not
        # grow with size)
        [sys.executable, "-m", "zpp_jax", "profile", "--link", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    link = json.loads(out.read_text())
    assert link["bytes_per_s"] > 0 and link["latency_s"] >= 0
    assert [p["bytes"] for p in link["points"]] == [
        4096,
        65536,
        262144,
        1048576,
        4194304,
        16777216,
        67108864,
    ]
    assert all(p["seconds"] > 0 for p in link["points"])
    args = ["plan", "--layers", "4", "--hidden", "64", "--seq", "96", "--stages", "2", "--json"]
    assert main([*args, "--link", str(out)]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["kind"] == "link" and cost["bytes_per_s"] == link["bytes_per_s"]
    assert cost["latency_s"] == link["latency_s"] and cost["compute"]["kind"] == "analytic"
