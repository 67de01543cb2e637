"""What every results page shares: its folder, the machine it was made on,
its JSON and its plots.

A benchmark that makes a page calls `prepare(out, name, overwrite)` before it
measures anything (so an earlier page is refused at once, not after an
hour), then `write_json`, `figure`/`save` and `write_page`. The page states
the command that made it and the machine (`machine_line`).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import sys


def prepare(out: pathlib.Path, name: str, overwrite: bool) -> None:
    """Create `out`; refuse to replace an earlier `out/name.json` unless
    `overwrite`, naming the flag."""
    if (out / f"{name}.json").exists() and not overwrite:
        sys.exit(f"{out}/{name}.json exists: pass --overwrite to replace it")
    out.mkdir(parents=True, exist_ok=True)


def command() -> str:
    """The command line that is running, as run from the repository root."""
    script = pathlib.Path(sys.argv[0]).resolve()
    root = pathlib.Path(__file__).resolve().parent.parent
    return shlex.join(["python", str(script.relative_to(root)), *sys.argv[1:]])


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine and software a measurement ran on."""
    import jax

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1),
        "system": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def machine_line(m: dict) -> str:
    """One sentence for the page: when and where it was measured."""
    return (
        f"Measured on {m['date']} on a machine with {m['cpus']} cores ({m['cpu']}) and "
        f"{m['memory_gib']} GiB ({m['system']}), Python {m['python']}, jax {m['jax']}."
    )


def write_json(out: pathlib.Path, name: str, data: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def figure(*args, **kwargs):
    """A matplotlib figure and axes, drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def ranked_steps(ax, rows: list[dict], chosen: str, unit: float, xlabel: str, title: str) -> None:
    """`zpp tune`'s measured rows on `ax` as bars, fastest on top, their
    ``step_s`` times `unit`; the `chosen` setting's bar red."""
    rows = sorted((x for x in rows if x.get("step_s")), key=lambda x: x["step_s"])
    colors = ["C3" if x["name"] == chosen else "C0" for x in rows]
    ax.barh([x["name"] for x in rows], [x["step_s"] * unit for x in rows], color=colors)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=6)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def save(fig, path: pathlib.Path, titled: bool = False) -> None:
    """Write `fig` as a PNG; `titled` leaves room for its suptitle."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0, 1, 0.95) if titled else None)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_page(out: pathlib.Path, text: str) -> None:
    """`out/report.md`, and the same text on stdout."""
    (out / "report.md").write_text(text)
    print(text)


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
