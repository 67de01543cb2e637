"""Compile every case of `tests/gpu_cases.py` for 2 x 4 H200 GPUs and write
its schedule record to `overlap.json` beside this script, with the jax
version that compiled them, after printing how it differs from the file's
(nothing runs, but each case compiles twice for the link model: long on
a CPU).

Needs the gpu-aot extra and $ZPP_GPU_TARGET_CONFIG, as the gpu_aot tests
do. Run from the repository root:

    JAX_PLATFORMS=cpu ZPP_GPU_TARGET_CONFIG=h200.txtpb \\
        python tests/gpu_baselines/regenerate.py [--out FILE] [--check]

``--check`` writes nothing and exits 1 when a record differs.
"""

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402

# A compile-only client cannot load programs back from the persistent cache.
jax.config.update("jax_enable_compilation_cache", False)

import gpu_cases  # noqa: E402

BASELINE = HERE / "overlap.json"


def records() -> dict:
    out = {}
    for name, config, unroll in gpu_cases.CASES:
        key = gpu_cases.key(name, config, unroll)
        print(f"compiling {key}", file=sys.stderr, flush=True)
        out[key] = gpu_cases.schedule_record(gpu_cases.report(name, config, unroll=unroll))
    return out


def differences(old: dict, new: dict) -> list[str]:
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) != new.get(key):
            was, now = json.dumps(old.get(key)), json.dumps(new.get(key))
            lines.append(f"{key}:\n  was {was}\n  now {now}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(BASELINE), help="where to write (default: overlap.json)")
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = p.parse_args(argv)
    old = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    new = records()
    diff = differences(old.get("cases", {}), new)
    print(f"baseline made with jax {old.get('jax')}; this is jax {jax.__version__}")
    print("\n".join(diff) if diff else "no difference from the baseline")
    if args.check:
        return 1 if diff else 0
    baseline = {"jax": jax.__version__, "cases": new}
    pathlib.Path(args.out).write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
