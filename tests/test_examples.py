import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", ["nnx_train.py", "pmap_train.py", "linen_train.py", "sharded_layer.py"]
)
def test_example_runs(script):
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    losses = [float(line.split()[-1]) for line in r.stdout.splitlines() if "loss" in line]
    assert len(losses) == 10 and losses[-1] < losses[0]


@pytest.mark.slow
def test_multihost_example_under_zpp_launch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZPP_")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "zpp_jax",
            "launch",
            "--nodes",
            "2",
            "--",
            "python",
            str(ROOT / "examples" / "multihost.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [line for line in r.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 5 and all("2 processes" in line for line in steps)
    losses = [float(line.split()[3]) for line in steps]
    assert losses[-1] < losses[0]
