"""`zpp tune` on two nodes over a shaped link, against a full sweep.

    sudo python benchmarks/cluster/tune.py --out docs/results/DATE-tune

For each link rate, the two network namespaces of `run.py` are joined by a
veth pair shaped at both ends with `tc ... tbf`, and `zpp tune` runs as two
`jax.distributed` processes (one per namespace, 4 CPU devices each, a
2 x 4 mesh), twice:

- **as a user runs it**: told the link (`--link intra=100,inter=RATE`), so
  it prunes the settings whose link time alone exceeds the fastest step,
  within its default budget;
- **a full sweep**: without `--link` (nothing pruned), a budget that
  compiles every candidate within the default ``--max-grad-error``, and
  its 6 fastest timed again side by side (`--confirm 6`).

The page reports, per rate, the setting each chose, its step, the compiles
and the wall time, and the chosen setting's step against the full sweep's
fastest. Writes `tune.json`, `tune.png` and `report.md`. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import pages  # noqa: E402
import run as cluster  # noqa: E402
import shaping  # noqa: E402

MODEL = ["--model", "small", "--seq", "64", "--batch", "16", "--steps", "3", "--warmup", "1"]
# The sweep times more of its fastest side by side than a user's run (3), so
# that the setting the user's run chose is likely among them.
SWEEP_CONFIRM = 6


def tune_in_namespaces(flags: list[str], out: pathlib.Path, timeout: float, port: int) -> dict:
    """`zpp tune` as two processes, one per namespace, their coordinator on
    `port`; the provenance it wrote with the winner (its rows, compiles and
    seconds)."""
    procs = []
    for i, ns in enumerate(cluster.NAMESPACES):
        env = cluster.node_env(i, port=port)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "zpp_jax", "tune", "--quiet"]
        cmd += [*MODEL, *flags, "--out", str(out)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    start = time.monotonic()
    results = [p.communicate(timeout=timeout) for p in procs]
    wall = time.monotonic() - start
    for p, (_, err) in zip(procs, results, strict=True):
        if p.returncode:
            raise RuntimeError(f"zpp tune exited with {p.returncode}:\n{err[-3000:]}")
    print(results[0][0], flush=True)
    about = json.loads(out.read_text())["about"]
    return {**about, "wall_s": wall}


def one_rate(rate: str, work: pathlib.Path, timeout: float, port: int) -> dict:
    for ns, link in zip(cluster.NAMESPACES, cluster.LINKS, strict=True):
        cluster._in_ns(ns, *shaping.tc_command(link, rate))
    gbps = shaping.rate_bits(rate) / 8e9
    link = ["--link", f"intra=100,inter={gbps:g}"]
    tuned = tune_in_namespaces(link, work / f"{rate}-tuned.json", timeout, port)
    sweep = ["--budget", "100", "--confirm", str(SWEEP_CONFIRM)]
    full = tune_in_namespaces(sweep, work / f"{rate}-full.json", timeout, port + 1)
    return {"rate": rate, "tuned": tuned, "full": full}


def verdict(r: dict) -> dict:
    """The chosen setting's step against the full sweep's choice, its
    fastest: across the two runs, and within the sweep (side by side when
    the sweep timed the chosen setting again beside its own)."""
    full = {row["name"]: row for row in r["full"]["rows"] if row.get("step_s")}
    best = full[r["full"]["setting"]]
    chosen = r["tuned"]["setting"]
    again = full.get(chosen, {})
    return {
        "chosen": chosen,
        "chosen_step_s": r["tuned"]["step_s"],
        "chosen_step_in_sweep_s": again.get("step_s"),
        "side_by_side": bool(again.get("confirmed")),
        "best": best["name"],
        "best_step_s": best["step_s"],
        "vs_best": r["tuned"]["step_s"] / best["step_s"],
        "vs_best_in_sweep": again["step_s"] / best["step_s"] if again else None,
    }


def plot(results: list[dict], path: pathlib.Path) -> None:
    fig, axes = pages.figure(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        chosen = r["tuned"]["setting"]
        title = f"{r['rate']}: zpp tune chose {chosen} (red)"
        pages.ranked_steps(ax, r["full"]["rows"], chosen, 1, "step, s (full sweep)", title)
    pages.save(fig, path)


def page(result: dict) -> str:
    header = ["link", "zpp tune chose", "its step", "compiles", "wall time"]
    header += ["full sweep's fastest", "its step", "compiles", "wall time", "chosen / fastest"]
    rows = []
    for r in result["rates"]:
        v = r["verdict"]
        again, how = v["vs_best_in_sweep"], "side by side" if v["side_by_side"] else "once"
        ratio = f"{v['vs_best']:.3f}" + (f" ({again:.3f} in the sweep, {how})" if again else "")
        rows.append(
            [
                r["rate"], v["chosen"], f"{v['chosen_step_s'] * 1e3:.0f} ms",
                r["tuned"]["compiles"], f"{r['tuned']['wall_s']:.0f} s",
                v["best"], f"{v['best_step_s'] * 1e3:.0f} ms",
                r["full"]["compiles"], f"{r['full']['wall_s']:.0f} s", ratio,
            ]
        )  # fmt: skip
    return (
        "# zpp tune over a shaped link, against a full sweep\n\n"
        f"Made by `{result['command']}` (as root). {pages.machine_line(result['machine'])}\n\n"
        "Two `jax.distributed` processes in network namespaces joined by a veth pair shaped "
        "at both ends (`benchmarks/cluster/`), 4 CPU devices each (a 2 x 4 mesh); "
        f"`zpp tune {' '.join(MODEL)}`, run as a user would (told the link: "
        "`--link intra=100,inter=RATE`, default budget) and as a full sweep (no link "
        "given, so nothing is pruned, `--budget 100 --confirm 6`); in both, a setting "
        "whose gradient error exceeds the default `--max-grad-error` (int4 weights) is not "
        "compiled. Steps are medians on this machine, where the 8 devices share its cores; "
        "each run times its fastest settings (3, the default; the sweep 6) again side by "
        'side, one step of each in turn, and chooses among them, so "its step" is that '
        "median. \"chosen / fastest\" is the chosen setting's step over the full sweep's "
        "choice (in brackets: with the chosen setting's step as the sweep measured it, side "
        "by side with the sweep's choice when it was among the sweep's 6, or else once, in "
        "the search). Data: [tune.json](tune.json).\n\n"
        + pages.table(header, rows)
        + "\n\n![every setting per link](tune.png)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--rates", nargs="+", default=["200mbit", "1gbit", "10gbit"])
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    pages.prepare(args.out, "tune", args.overwrite)
    if os.geteuid() != 0:
        sys.exit("benchmarks/cluster/tune.py needs root (network namespaces and tc)")
    results = []
    try:
        cluster.setup()
        with tempfile.TemporaryDirectory() as tmp:
            for i, rate in enumerate(args.rates):
                r = one_rate(rate, pathlib.Path(tmp), args.timeout, cluster.PORT + 2 * i)
                r["verdict"] = verdict(r)
                print(json.dumps(r["verdict"]), flush=True)
                results.append(r)
    finally:
        cluster.cleanup()
    result = {"command": pages.command(), "machine": pages.machine(), "rates": results}
    pages.write_json(args.out, "tune", result)
    plot(results, args.out / "tune.png")
    pages.write_page(args.out, page(result))


if __name__ == "__main__":
    main()
