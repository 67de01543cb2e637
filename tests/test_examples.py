import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script", ["pjit_train.py", "pmap_train.py", "linen_train.py", "sharded_layer.py"]
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
