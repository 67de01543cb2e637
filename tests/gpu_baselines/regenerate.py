"""Compile every case of `tests/gpu_cases.py` for 2 x 4 H200 GPUs and write
its schedule record to `overlap.json` beside this script, with the jax
version that compiled them, after printing how it differs from the file's
(nothing runs, but each case compiles twice for the link model: long on
a CPU).

Needs the gpu-aot extra and $ZPP_GPU_TARGET_CONFIG, as the gpu_aot tests
do. Run from the repository root:

    JAX_PLATFORMS=cpu ZPP_GPU_TARGET_CONFIG=h200.txtpb \\
        python tests/gpu_baselines/regenerate.py [--out FILE] [--check]

``--check`` writes nothing and exits 1 when a record differs. ``--only
KEY ...`` compiles those cases alone and keeps the file's other records
(same jax only): for a change known to touch only those steps.
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


def records(only=None) -> dict:
    """The schedule record of every case, or of the cases keyed in `only`."""
    out = {}
    for name, config, unroll in gpu_cases.CASES:
        key = gpu_cases.key(name, config, unroll)
        if only is not None and key not in only:
            continue
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
    p.add_argument(
        "--only",
        nargs="+",
        metavar="KEY",
        help="compile these cases (e.g. llama-7b/zeropp_ef) and keep the file's other records; "
        "the file must have been made by this jax",
    )
    args = p.parse_args(argv)
    old = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    keys = {gpu_cases.key(*case) for case in gpu_cases.CASES}
    if args.only and set(args.only) - keys:
        return f"--only: unknown cases {sorted(set(args.only) - keys)}; cases: {sorted(keys)}"
    if args.only and old.get("jax") != jax.__version__:
        return f"--only: the file was made by jax {old.get('jax')}, this is {jax.__version__}"
    kept = {k: v for k, v in old.get("cases", {}).items() if args.only and k not in args.only}
    new = {**kept, **records(args.only)}
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
