"""The script the lent GPU machine runs, everywhere but on a GPU: its dry
run writes a whole results page, and the wheels it needs are found from
their metadata."""

import importlib.util
import json
import pathlib
import subprocess
import sys
import zipfile

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = {"plain jax.jit", "zero3 (bf16 wire)", "zeropp", "zeropp + error feedback"}


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "gpu" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_dry_run_writes_the_page(tmp_path):
    page = tmp_path / "page"
    command = [sys.executable, "benchmarks/gpu/run.py", "--allow-cpu", "--model", "tiny"]
    r = subprocess.run(
        [*command, "--steps", "2", "--json", str(page)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    gpu = json.loads((page / "gpu.json").read_text())
    assert gpu["errors"] == {} and gpu["jax"] == jax.__version__
    # 7 ops x int8, int4 x 2 roundings x 2 sizes (one leaving the last tile part empty)
    assert len(gpu["kernels"]) == 56 and all(k["bit_identical"] for k in gpu["kernels"])
    runs = {"dequantize_runs", "dequantize_runs, a gathered wire"}
    assert runs <= {k["op"] for k in gpu["kernels"]}
    assert set(gpu["step_s"]) == METHODS and all(t > 0 for t in gpu["step_s"].values())
    assert gpu["estimate_s"] == dict.fromkeys(METHODS)  # XLA estimates GPU schedules only
    report = (page / "report.md").read_text()
    assert f"jax {jax.__version__}" in report and "| zeropp + error feedback |" in report
    made = "Made by `python benchmarks/gpu/run.py --allow-cpu --model tiny --steps 2 --json"
    assert made in report and "Measured on " in report
    assert (page / "bandwidth.png").stat().st_size > 1000
    again = subprocess.run([*command, "--parts", "kernels", "--json", str(page)], cwd=ROOT)
    assert again.returncode != 0  # a page is never written over


def _wheel(folder, name, requires):
    name = name.replace("-", "_")  # as wheel file names spell it
    path = folder / f"{name}-1.0-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\n{meta}")
    return path


def test_the_wheels_are_what_the_machine_lacks_and_what_they_need(tmp_path, monkeypatch):
    wheels = _load("wheels.py")
    needs = {
        # grain needs numpy (the machine has it) and array-record (it does not)
        "grain": ["numpy>=1.26", "array-record>=0.8", "pytest; extra == 'testing'"],
        "array-record": ["absl-py", "etils[epath]; python_version >= '3.11'"],
    }
    fetched = []

    def download(requirement, folder):
        fetched.append(requirement.name)
        return _wheel(folder, requirement.name, needs.get(requirement.name, []))

    monkeypatch.setattr(wheels, "download", download)
    got = wheels.missing(["flax"], tmp_path)
    # flax is on the machine: it travels only when asked for (--also), in the
    # version zpp-jax requires
    assert fetched == ["flax", "grain", "array-record"]
    assert [w.name.split("-")[0] for w in got] == ["flax", "grain", "array_record"]
    assert [str(r) for r in wheels.requirements_of(got[1])] == ["numpy>=1.26", "array-record>=0.8"]
