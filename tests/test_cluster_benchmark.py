"""The two-node benchmark's pieces that run without root: rate parsing and
one step of every method in one process."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "cluster" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rates_and_tc_commands():
    shaping = _load("shaping.py")
    assert shaping.rate_bits("10gbit") == 10e9
    assert shaping.rate_bits("200mbit") == 200e6
    assert shaping.rate_bits("unshaped") == float("inf")
    for bad in ("fast", "xmbit"):
        with pytest.raises(ValueError, match="200mbit"):
            shaping.rate_bits(bad)
    cmd = shaping.tc_command("veth0", "1gbit")
    assert cmd[:7] == ["tc", "qdisc", "replace", "dev", "veth0", "root", "tbf"]
    assert cmd[7:11] == ["rate", "1gbit", "burst", str(125_000)]  # 1 ms at 1 Gbit/s
    assert shaping.tc_command("veth0", "1gbit", burst_ms=10)[10] == str(1_250_000)
    assert shaping.tc_command("veth0", "10mbit")[10] == str(16 * 1024)  # the floor
    assert shaping.tc_command("veth0", "unshaped") == ["tc", "qdisc", "del", "dev", "veth0", "root"]


def test_table_ratios_and_floors():
    """ZeRO++'s ratios and each method's step over max(compute, link time),
    compute being the method's step on the unshaped link."""
    run = _load("run.py")

    def rec(method, rate, median, mb):
        size = dict(model={"d_model": 768}, tokens_per_device=16)
        link = dict(link_tx_bytes=mb * 1e6, link_rx_bytes=mb * 1e6)
        return dict(method=method, rate=rate, median_s=median, **size, **link)

    records = [
        rec("zero3", "unshaped", 0.5, 200),
        rec("zeropp", "unshaped", 0.4, 20),
        rec("jit", "unshaped", 0.3, 25),
        rec("zero3", "200mbit", 10.0, 200),  # link: 8 s
        rec("zeropp", "200mbit", 1.2, 20),  # link: 0.8 s
        rec("jit", "200mbit", 1.5, 25),  # link: 1.0 s
        rec("jit_fsdp", "200mbit", 2.4, 40),  # link: 1.6 s; never run unshaped
    ]
    rows = run.table(records).splitlines()
    assert len(rows) == 4
    cells = [c.strip() for c in rows[3].split("|")[1:-1]]
    assert cells[:7] == ["768", "16", "200mbit", "10.000 s", "1.200 s", "1.500 s", "2.400 s"]
    assert cells[7:10] == ["8.33x", "1.25x", "2.00x"]
    assert cells[10] == "200.0 / 20.0 / 25.0 / 40.0"
    assert cells[11] == "1.25 / 1.50 / 1.50 / -"
    unshaped = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert unshaped[6] == "-" and unshaped[9] == "-"  # jit_fsdp did not run there


def test_node_environment(monkeypatch):
    run = _load("run.py")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("MALLOC_TOP_PAD_", "12345")
    env = run.node_env(1)
    assert "XLA_FLAGS" not in env and env["ZPP_PROCESS_ID"] == "1"
    assert env["ZPP_LOCAL_CPU_DEVICES"] == "4" and env["ZPP_NUM_PROCESSES"] == "2"
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(1 << 32)
    assert env["MALLOC_TOP_PAD_"] == "12345"  # the caller's own setting wins
    monkeypatch.delenv("MALLOC_TOP_PAD_")
    assert not any(k.startswith("MALLOC_") for k in run.node_env(0, system_malloc=True))
    alone = run.node_env(0, processes=1)  # --no-network: one process, all 8 devices
    assert alone["ZPP_LOCAL_CPU_DEVICES"] == "8"
    assert not any(k in alone for k in ("ZPP_COORDINATOR_ADDRESS", "ZPP_NUM_PROCESSES"))


@pytest.mark.slow
def test_every_method_runs_a_step():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZPP_")}
    env["ZPP_LOCAL_CPU_DEVICES"] = "8"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "cluster" / "node.py"),
            "--d-model",
            "32",
            "--layers",
            "2",
            "--heads",
            "2",
            "--d-ff",
            "64",
            "--seq",
            "16",
            "--batch",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    recs = _load("run.py").parse_records(r.stdout)
    assert [x["method"] for x in recs] == ["zero3", "zeropp", "jit", "jit_fsdp"]
    # The same model and batch for every method (how close their losses are
    # is the benchmark's to report, not a test's to assert).
    assert len({json.dumps(x["model"], sort_keys=True) for x in recs}) == 1
    assert len({(x["params"], x["tokens_per_device"]) for x in recs}) == 1
    for x in recs:
        assert len(x["losses"]) == len(x["times_s"]) == 2 and np.all(np.isfinite(x["losses"]))
