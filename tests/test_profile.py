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
    for r in rows:
        assert float(model(1, r["length"], r["context"])) == pytest.approx(r["seconds"], rel=1e-6)
    with pytest.raises(ValueError, match="at least two lengths"):
        fit([{"length": 8, "context": 0, "seconds": 1.0}])


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
