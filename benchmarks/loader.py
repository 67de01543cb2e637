"""The data loader against the step: how long `zpp train` waits for its
batch, as a share of the step, on the `small` GPT (2 x 4 emulated devices).

Three inputs, each trained for --steps steps:
  byte   the default corpus (the Python standard library's source), bytes;
  bpe    --mb MB of that text in a file, --tokenizer bpe:N trained on it;
  bin    the same BPE ids as a memory-mapped nanoGPT .bin (+ its tokenizer.json).

Reports the median step, the median wait for the batch, and the summed wait
over the summed step time (steps after the first, which compiles).

    python benchmarks/loader.py --steps 30
"""

import argparse
import os
import pathlib
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--mb", type=float, default=4.0, help="text for the BPE runs, in MB")
parser.add_argument("--bpe", type=int, default=4096)
args = parser.parse_args()
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

from zpp_jax.data import stdlib_corpus  # noqa: E402
from zpp_jax.models import GPTConfig  # noqa: E402
from zpp_jax.recipes import (  # noqa: E402
    RunConfig,
    corpus,  # noqa: E402
    run,
)

seq = GPTConfig.preset("small").seq_len

base = RunConfig(model="small", steps=args.steps, batch=args.batch, eval_every=0, progress=False)
folder = pathlib.Path(tempfile.mkdtemp(prefix="zpp-loader-"))
text = folder / "text.txt"
text.write_bytes(stdlib_corpus(int(args.mb * 2**20)).tobytes())
t0 = time.perf_counter()
made = corpus.load(RunConfig(data=str(text), tokenizer=f"bpe:{args.bpe}"))
bpe_s = time.perf_counter() - t0
made.tokenizer.save(folder / "tokenizer.json")
made.train.astype(np.uint16).tofile(folder / "train.bin")
made.val.astype(np.uint16).tofile(folder / "val.bin")
runs = {
    "byte": base,
    "bpe": RunConfig(**{**base.__dict__, "data": str(text), "tokenizer": f"bpe:{args.bpe}"}),
    "bin": RunConfig(
        **{
            **base.__dict__,
            "data": str(folder / "train.bin"),
            "val_data": str(folder / "val.bin"),
            "tokenizer": str(folder / "tokenizer.json"),
        }
    ),
}
print(f"BPE of {args.bpe} ids trained and {args.mb} MB tokenized in {bpe_s:.1f} s")
print(f"{'input':6} {'step (median)':>14} {'wait (median)':>14} {'wait / step':>12}")
for name, cfg in runs.items():
    records = run(cfg)[1:]  # the first step warms up
    step = np.array([cfg.batch * seq / r["tokens_per_s"] for r in records])
    wait = np.array([r["data_wait_s"] for r in records])
    print(
        f"{name:6} {np.median(step) * 1e3:11.1f} ms {np.median(wait) * 1e3:11.3f} ms "
        f"{wait.sum() / step.sum():11.2%}"
    )
