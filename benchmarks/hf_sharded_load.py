"""Memory of `zpp_jax.hf.load(mesh=)`: a checkpoint of about 1B parameters
(Llama 3.2 1B's shapes, random bf16, in shards with an index) loaded over
2 processes x 4 emulated CPU devices (`jax.distributed`, gloo).

Each process reports how much its resident memory grew during the load:
its peak resident memory (VmHWM, file pages the safetensors reader maps
included) and, sampled every 5 ms, its peak anonymous memory (the arrays).
The expectation it checks: growth of at most its own devices' blocks (fp32)
plus one tensor (fp32) plus 10%. Writes JSON.

    python benchmarks/hf_sharded_load.py --out docs/results/DATE-hf/sharded_load.json

The checkpoint (about 2.5 GB) goes to a temporary directory, removed after.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

CONFIG = {  # Llama 3.2 1B (1.24e9 parameters)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "head_dim": 64,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def write_checkpoint(directory: pathlib.Path, max_shard_bytes: int = 2**30) -> int:
    """A random bf16 checkpoint of CONFIG's shapes, one tensor in memory at
    a time; returns its parameter count."""
    import numpy as np
    from flax import nnx

    from zpp_jax.hf.checkpoint import Source, tensor_names
    from zpp_jax.hf.config import parse_config
    from zpp_jax.hf.files import plan_shards, shard_file_names, write_streamed
    from zpp_jax.hf.model import llama_config
    from zpp_jax.models import Llama

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    cfg = llama_config(parse_config(CONFIG))

    shapes = {
        k: v.get_value().shape
        for k, v in nnx.to_flat_state(
            nnx.state(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))), nnx.Param)
        )
    }
    specs = {}
    for name, key, transposed in tensor_names(cfg):
        specs[name] = (Source((name,), transposed, False).stored_shape(shapes[key]), "bfloat16")
    sizes = {n: int(np.prod(s)) * 2 for n, (s, _) in specs.items()}
    groups = plan_shards(sizes, max_shard_bytes)
    rng = np.random.default_rng(0)
    weight_map = {}
    for names, file in zip(groups, shard_file_names(len(groups)), strict=True):
        part = {n: specs[n] for n in names}
        write_streamed(
            directory / file, part, lambda n: 0.02 * rng.standard_normal(specs[n][0], np.float32)
        )
        weight_map |= {n: file for n in names}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(int(np.prod(s)) for s, _ in specs.values())


def _status(field: str) -> int:
    """A /proc/self/status field, in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def process_main(directory: str, out: str) -> None:
    """One process of the job: join it, load sharded, report memory."""
    import numpy as np

    from zpp_jax.distributed import initialize

    initialize()
    import jax
    from flax import nnx

    import zpp_jax as zpp
    from zpp_jax import hf

    mesh = zpp.make_mesh(2, 4)
    before_rss, before_anon = _status("VmRSS"), _status("RssAnon")
    peak_anon, done = [before_anon], threading.Event()

    def sample():
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = hf.load(directory, mesh=mesh, config=zpp.ZeroPPConfig.zero3(comm_dtype=None))
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    own = largest = 0
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = var.get_value()
        own += sum(s.data.nbytes for s in array.addressable_shards)
        largest = max(largest, int(np.prod(array.shape)) * 4)
    report = {
        "process": jax.process_index(),
        "load_seconds": seconds,
        "own_blocks_bytes": own,
        "largest_tensor_fp32_bytes": largest,
        "peak_rss_growth_bytes": _status("VmHWM") - before_rss,
        "peak_anon_growth_bytes": peak_anon[0] - before_anon,
        "file_pages_after_bytes": _status("RssFile"),
    }
    pathlib.Path(out).write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if args.out.exists() and not args.overwrite:
        sys.exit(f"{args.out} exists: pass --overwrite to replace it")
    from zpp_jax.launch import free_port, process_env

    work = pathlib.Path(tempfile.mkdtemp(prefix="hf-sharded-load-"))
    try:
        params = write_checkpoint(work / "ckpt")
        coordinator = f"127.0.0.1:{free_port()}"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--process",
                    str(work / "ckpt"),
                    str(work / f"{i}.json"),
                ],
                env=process_env(i, 2, 4, coordinator),
            )
            for i in range(2)
        ]
        if any(p.wait(timeout=1800) for p in procs):
            sys.exit("a process failed")
        reports = [json.loads((work / f"{i}.json").read_text()) for i in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _summarize(params, reports, args.out)


def _summarize(params: int, reports: list[dict], out: pathlib.Path) -> None:
    gib = 2**30
    for r in reports:
        bound = 1.1 * (r["own_blocks_bytes"] + r["largest_tensor_fp32_bytes"])
        r["bound_bytes"] = bound
        r["within_bound"] = max(r["peak_rss_growth_bytes"], r["peak_anon_growth_bytes"]) <= bound
        print(
            f"process {r['process']}: own blocks {r['own_blocks_bytes'] / gib:.2f} GiB, largest "
            f"tensor {r['largest_tensor_fp32_bytes'] / gib:.2f} GiB; peak growth: resident "
            f"{r['peak_rss_growth_bytes'] / gib:.2f} GiB, anonymous "
            f"{r['peak_anon_growth_bytes'] / gib:.2f} GiB; bound {bound / gib:.2f} GiB; "
            f"{r['load_seconds']:.1f} s"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"parameters": params, "mesh": "2 processes x 4 CPU devices", "processes": reports}
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_page(params, reports, out.name))
    if not all(r["within_bound"] for r in reports):
        sys.exit("a process grew past its own blocks plus one tensor")


def _page(params: int, reports: list[dict], json_name: str) -> str:
    gib = 2**30
    rows = [
        "| process | own blocks (fp32) | largest tensor (fp32) | peak resident growth | "
        "peak anonymous growth | bound | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        cells = [r[k] / gib for k in ("own_blocks_bytes", "largest_tensor_fp32_bytes")]
        cells += [r[k] / gib for k in ("peak_rss_growth_bytes", "peak_anon_growth_bytes")]
        cells.append(r["bound_bytes"] / gib)
        rows.append(
            f"| {r['process']} | "
            + " | ".join(f"{c:.2f} GiB" for c in cells)
            + f" | {r['load_seconds']:.1f} s |"
        )
    return (
        "# Loading a checkpoint sharded: memory per process\n\n"
        "Made by `python benchmarks/hf_sharded_load.py --out DIR/sharded_load.json` on a 2-core "
        "CPU machine with 24 GiB: a random bf16 checkpoint of Llama 3.2 1B's shapes "
        f"({params / 1e9:.2f}e9 parameters, shards of at most 1 GiB with an index) loaded with "
        "`hf.load(mesh=make_mesh(2, 4), config=ZeroPPConfig.zero3(comm_dtype=None))` by 2 "
        "processes of 4 emulated devices each (`jax.distributed`, gloo). Growth is measured "
        "from just before the load; the bound is 1.1 x (own blocks + largest tensor). Data: "
        f"[{json_name}]({json_name}).\n\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--process":
        process_main(sys.argv[2], sys.argv[3])
    else:
        main()
