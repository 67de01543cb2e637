"""The data loader against the step: how long `zpp train` waits for its
batch, as a share of the step, on the `small` GPT (2 x 4 emulated devices).

Three inputs, each trained for --steps steps:
  byte   the default corpus (the Python standard library's source), bytes;
  bpe    --mb MB of that text in a file, --tokenizer bpe:N trained on it;
  bin    the same BPE ids as a memory-mapped nanoGPT .bin (+ its tokenizer.json).

Reports the median step, the median wait for the batch, and the summed wait
over the summed step time (steps after the first, which compiles). Writes
`loader.json`, `loader.png` and `report.md` in --out.

    python benchmarks/loader.py --out docs/results/DATE-loader
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import pages


def inputs(args, folder: pathlib.Path) -> tuple[dict, float]:
    """The three runs' configs, and the seconds BPE training and
    tokenizing took."""
    from zpp_jax.data import stdlib_corpus
    from zpp_jax.recipes import RunConfig, corpus

    base = RunConfig(
        model="small", steps=args.steps, batch=args.batch, eval_every=0, progress=False
    )
    text = folder / "text.txt"
    text.write_bytes(stdlib_corpus(int(args.mb * 2**20)).tobytes())
    t0 = time.perf_counter()
    made = corpus.load(RunConfig(data=str(text), tokenizer=f"bpe:{args.bpe}"))
    bpe_s = time.perf_counter() - t0
    made.tokenizer.save(folder / "tokenizer.json")
    made.train.astype("uint16").tofile(folder / "train.bin")
    made.val.astype("uint16").tofile(folder / "val.bin")
    bpe = {"data": str(text), "tokenizer": f"bpe:{args.bpe}"}
    binary = {
        "data": str(folder / "train.bin"),
        "val_data": str(folder / "val.bin"),
        "tokenizer": str(folder / "tokenizer.json"),
    }
    runs = {
        "byte": base,
        "bpe": RunConfig(**{**base.__dict__, **bpe}),
        "bin": RunConfig(**{**base.__dict__, **binary}),
    }
    return runs, bpe_s


def measure(cfg) -> dict:
    """Per step after the first: the step and the wait for its batch, s."""
    from zpp_jax.models import GPTConfig
    from zpp_jax.recipes import run

    seq = GPTConfig.preset(cfg.model).seq_len
    records = run(cfg)[1:]  # the first step compiles
    step = [cfg.batch * seq / r["tokens_per_s"] for r in records]
    wait = [r["data_wait_s"] for r in records]
    return {"step_s": step, "wait_s": wait, "wait_share": sum(wait) / sum(step)}


def plot(results: dict, path: pathlib.Path) -> None:
    fig, ax = pages.figure(figsize=(6, 3.5))
    for name, r in results.items():
        ax.plot([1e3 * w for w in r["wait_s"]], "o-", ms=3, label=f"{name}: wait for the batch")
    ax.plot([1e3 * s for s in results["byte"]["step_s"]], "k--", lw=0.8, label="byte: the step")
    ax.set_yscale("log")
    ax.set_xlabel("step (after the first)")
    ax.set_ylabel("ms")
    ax.set_title("zpp train's wait for its batch against the step", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    pages.save(fig, path)


def page(result: dict) -> str:
    import statistics

    names = {
        "byte": "bytes of the default corpus",
        "bpe": f"{result['mb']} MB of text, `--tokenizer bpe:{result['bpe']}`",
        "bin": "the same ids as a memory-mapped `.bin`",
    }
    rows = []
    for name, r in result["runs"].items():
        step = statistics.median(r["step_s"]) * 1e3
        wait = statistics.median(r["wait_s"]) * 1e3
        rows.append([names[name], f"{step:.1f} ms", f"{wait:.3f} ms", f"{r['wait_share']:.2%}"])
    header = ["input", "step (median)", "wait for the batch (median)", "summed wait / step"]
    return (
        "# The data loader's wait\n\n"
        f"Made by `{result['command']}`. "
        f"{pages.machine_line(result['machine'])}\n\n"
        f"The `small` GPT on 2 x 4 emulated CPU devices, batch {result['batch']}, trained by "
        "`zpp_jax.recipes.run` for each input; the steps after the first (which compiles). "
        f"Training the BPE and tokenizing the {result['mb']} MB took {result['bpe_s']:.1f} s. "
        "Data: [loader.json](loader.json).\n\n"
        + pages.table(header, rows)
        + "\n\n![wait against step](loader.png)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mb", type=float, default=4.0, help="text for the BPE runs, in MB")
    parser.add_argument("--bpe", type=int, default=4096)
    args = parser.parse_args()
    pages.prepare(args.out, "loader", args.overwrite)
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    with tempfile.TemporaryDirectory(prefix="zpp-loader-") as tmp:
        configs, bpe_s = inputs(args, pathlib.Path(tmp))
        runs = {name: measure(cfg) for name, cfg in configs.items()}
    result = {
        "command": pages.command(),
        "machine": pages.machine(),
        **{k: getattr(args, k) for k in ("steps", "batch", "mb", "bpe")},
        "bpe_s": bpe_s,
        "runs": runs,
    }
    pages.write_json(args.out, "loader", result)
    plot(runs, args.out / "loader.png")
    pages.write_page(args.out, page(result))


if __name__ == "__main__":
    main()
