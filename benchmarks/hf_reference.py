"""zpp_jax.hf against transformers' own models: logits of small random
checkpoints of each family, written by `save_pretrained`.

For each family (Llama 2, Llama 3.1 with llama3 rope scaling, Llama 3.2
with tied embeddings, Mistral, Qwen2 with q/k/v biases and tied
embeddings) it checks, in fp32, against transformers' logits:

1. `hf.load`'s model;
2. the same checkpoint loaded sharded (``mesh=``, ZeRO-3 exact mode) on
   2 x 4 emulated devices;
3. `hf.save`'s checkpoint read back by ``from_pretrained``.

The norms and biases are drawn at random too, so that no weight is left at
its initial one or zero. torch and transformers run in another Python
(``--torch-python``, a virtual environment with both; they are not
dependencies of zpp-jax). Writes the errors as JSON and a results page
(``hf_reference.json`` and ``report.md`` in ``--out``).

    JAX_NUM_CPU_DEVICES=8 python benchmarks/hf_reference.py \\
        --torch-python /path/to/venv/bin/python --out docs/results/DATE-hf
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

FAMILIES = {
    "llama2": ("LlamaConfig", {}),
    "llama3.1": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama3.2": ("LlamaConfig", {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
}
SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
TOKENS = [[(7 * i + 3 * j) % 256 for j in range(24)] for i in range(2)]

# Runs in the torch Python: argv = (mode, directory).
TORCH_SIDE = r"""
import json, pathlib, sys
import numpy as np, torch, transformers
mode, root = sys.argv[1], pathlib.Path(sys.argv[2])
spec = json.loads((root / "spec.json").read_text())
tokens = torch.tensor(spec["tokens"])
for family, (cls, extra) in spec["families"].items():
    out = root / family
    if mode == "write":
        torch.manual_seed(0)
        config = getattr(transformers, cls)(**spec["sizes"], **extra)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", ".bias")):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
        model.save_pretrained(out / "hf")
        source = out / "hf"
    else:
        source = out / "saved"
        load = transformers.AutoModelForCausalLM.from_pretrained
        model = load(source, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
    np.save(out / f"{mode}_logits.npy", logits)
print(transformers.__version__, torch.__version__)
"""


def _torch(python: str, mode: str, root: pathlib.Path) -> str:
    run = subprocess.run(
        [python, "-c", TORCH_SIDE, mode, str(root)], capture_output=True, text=True, check=False
    )
    if run.returncode:
        sys.exit(f"the torch side failed:\n{run.stderr[-3000:]}")
    return run.stdout.strip()


def _error(got, want) -> float:
    """Largest difference, relative to the largest reference logit."""
    import numpy as np

    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def _check_family(root: pathlib.Path, family: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zpp_jax as zpp
    from zpp_jax import hf

    out = root / family
    want = np.load(out / "write_logits.npy")
    tokens = jnp.asarray(TOKENS, jnp.int32)
    plain = hf.load(out / "hf", seq_len=len(TOKENS[0]))
    mesh = zpp.make_mesh(2, 4)
    exact = zpp.ZeroPPConfig.zero3(comm_dtype=None)
    sharded = hf.load(out / "hf", seq_len=len(TOKENS[0]), mesh=mesh, config=exact)
    batch = jnp.tile(tokens, (4, 1))  # 8 rows: one per device
    sharded_logits = np.asarray(sharded(jax.device_put(batch, zpp.batch_sharding(mesh))))[:2]
    hf.save(plain, out / "saved")
    return {
        "load": _error(plain(tokens), want),
        "sharded_zero3": _error(sharded_logits, want),
        "largest_logit": float(np.max(np.abs(want))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-python", required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if (args.out / "hf_reference.json").exists() and not args.overwrite:
        sys.exit(f"{args.out} exists: pass --overwrite to replace it")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    root = pathlib.Path(tempfile.mkdtemp(prefix="hf-reference-"))
    spec = {"families": FAMILIES, "sizes": SIZES, "tokens": TOKENS}
    (root / "spec.json").write_text(json.dumps(spec))
    versions = _torch(args.torch_python, "write", root)
    results = {family: _check_family(root, family) for family in FAMILIES}
    _torch(args.torch_python, "reload", root)
    import numpy as np

    for family, result in results.items():
        want = np.load(root / family / "write_logits.npy")
        result["save_from_pretrained"] = _error(np.load(root / family / "reload_logits.npy"), want)
    report = {"transformers, torch": versions, "dtype": "float32", "errors": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_reference.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "report.md").write_text(_page(report))
    print(_table(results))


def _table(results: dict) -> str:
    rows = ["| family | hf.load | loaded sharded, ZeRO-3 exact | hf.save, then from_pretrained |"]
    rows.append("|---|---|---|---|")
    for family, r in results.items():
        cells = (r["load"], r["sharded_zero3"], r["save_from_pretrained"])
        rows.append(f"| {family} | " + " | ".join(f"{c:.2e}" for c in cells) + " |")
    return "\n".join(rows)


def _page(report: dict) -> str:
    return (
        "# Hugging Face checkpoints against transformers\n\n"
        "Made by `JAX_NUM_CPU_DEVICES=8 python benchmarks/hf_reference.py --torch-python "
        "VENV/bin/python --out DIR` on a 2-core CPU machine (8 emulated devices, mesh 2 x 4), "
        f"transformers and torch {report['transformers, torch']}.\n\n"
        "Small random checkpoints of each family, written by `save_pretrained` in fp32 (3 "
        "layers, 64 features, 4 query and 2 key/value heads, 256 tokens of vocabulary; "
        "norms and biases drawn at random). Each cell is the largest difference between "
        "zpp-jax's logits and transformers' on 2 sequences of 24 tokens, divided by the "
        "largest logit. The last column reads zpp-jax's saved checkpoint back with "
        "`from_pretrained`.\n\n" + _table(report["errors"]) + "\n"
    )


if __name__ == "__main__":
    main()
