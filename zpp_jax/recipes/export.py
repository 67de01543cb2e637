"""What `zpp export` runs: a run's checkpoint as a Hugging Face checkpoint.

A run of a Llama-family model keeps the model's ``config.json`` in its
checkpoint directory (beside ``tokenizer.json``): the one of the checkpoint
it started from (``--init``), or the one of its preset. With the run's
identity (saved in each checkpoint) that says how to rebuild the state's
structure; the checkpoint is restored onto a mesh of its own shape, and
its parameters written with `zpp_jax.hf.save`, the tokenizer copied beside
them.

Memory: the restored state (parameters and optimizer state) on the mesh's
devices, and one tensor at a time on the host while writing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil

from zpp_jax.config import ZeroPPConfig
from zpp_jax.errors import UsageError
from zpp_jax.recipes.config import RunConfig
from zpp_jax.recipes.runs import COMPANION_FILES, CONFIG_FILE


def run_config_of(identity: dict) -> RunConfig:
    """The `RunConfig` a checkpoint's identity describes (the fields that
    shape its state: the ZeRO++ configuration, the optimizer's settings)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"zero", "init", "tokenizer"}
    zero = {
        f.name: identity["zero"][f.name]
        for f in dataclasses.fields(ZeroPPConfig)
        if f.name in identity["zero"]
    }
    given = {k: v for k, v in identity.items() if k in fields}
    return RunConfig(zero=ZeroPPConfig(**zero), **given)


def restore_run_model(
    ckpt_dir: str | pathlib.Path, step: int | None = None, seq_len: int | None = None
):
    """The model of checkpoint `step` (default: the newest) of the run in
    `ckpt_dir`, sharded over this process's devices as one node; with the
    `RunConfig` its identity describes and the step restored.

    The model is the run's Llama-family model when the directory holds its
    config.json (built for sequences of `seq_len`, default the run's: any
    length within the checkpoint's positions, since rotary positions hold
    no parameter), else its preset (`--arch`, `--model`, the tokenizer's
    vocabulary; a GPT's learned positions are the run's length). Memory:
    the state (parameters and optimizer state), split over the devices.

    Raises:
      UsageError: no such checkpoint, or a token-pipeline run.
    """
    from flax import nnx

    from zpp_jax import hf
    from zpp_jax.checkpoint import Checkpointer
    from zpp_jax.lora import FROZEN, add_lora
    from zpp_jax.models import Llama
    from zpp_jax.recipes.optimizer import make_optimizer
    from zpp_jax.recipes.train import lora_targets, model_class, model_config
    from zpp_jax.train import Trainer

    ckpt_dir = pathlib.Path(ckpt_dir)
    step = checkpoint_step(ckpt_dir, step)
    checkpointer = Checkpointer(ckpt_dir)
    identity = checkpointer.read_meta(step)["identity"]
    cfg = run_config_of(identity)
    if cfg.stages > 1:
        raise UsageError("this run is a token pipeline (--stages); its checkpoints hold stages")
    if (ckpt_dir / CONFIG_FILE).is_file():
        length = cfg.seq_len if seq_len is None else seq_len
        model_cfg = hf.llama_config(hf.read_config(ckpt_dir), length, cfg.compute_dtype)
        model_type = Llama
    else:
        cfg = dataclasses.replace(cfg, vocab_size=identity["tokenizer"]["vocab_size"])
        model_cfg, model_type = model_config(cfg), model_class(cfg)

    def make():
        model = model_type(model_cfg, nnx.Rngs(0))
        if cfg.lora is None:
            return model
        return add_lora(model, cfg.lora, lora_targets(cfg), alpha=cfg.lora_alpha)

    mesh = _restore_mesh(ckpt_dir, step, cfg)
    freeze = None if cfg.lora is None else FROZEN
    trainer = Trainer(nnx.eval_shape(make), make_optimizer(cfg), mesh, cfg.zero, freeze=freeze)
    state, _ = checkpointer.restore(trainer.abstract_state(), step)
    return trainer.model(state), cfg, step


def checkpoint_step(ckpt_dir: pathlib.Path, step: int | None) -> int:
    """Checkpoint `step` of the run in `ckpt_dir` (default: its newest),
    checked to be there. Reads the directory's listing only.

    Raises:
      UsageError: no such directory, or no such checkpoint (naming the ones
        there are, and a Hugging Face checkpoint given for a run's).
    """
    from zpp_jax.checkpoint import Checkpointer, check_directory

    check_run_directory(ckpt_dir)
    check_directory(ckpt_dir)
    checkpointer = Checkpointer(ckpt_dir)
    steps = sorted(checkpointer.all_steps())
    chosen = checkpointer.latest_step() if step is None else step
    if chosen in steps:
        return chosen
    which = "" if step is None else f" {step}"
    there = f"it holds checkpoints {steps}" if steps else "it holds none"
    if not steps and any(ckpt_dir.glob("*.safetensors")):
        there += (
            " (it holds a Hugging Face checkpoint: pass the --ckpt-dir of a zpp train run, "
            "such as one started with --init there)"
        )
    raise UsageError(f"--ckpt-dir {ckpt_dir}: no checkpoint{which}; {there}")


def check_run_directory(ckpt_dir: pathlib.Path) -> None:
    """Raise UsageError unless `ckpt_dir` is a directory (a run's)."""
    if not ckpt_dir.exists():
        raise UsageError(f"--ckpt-dir {ckpt_dir} does not exist")
    if not ckpt_dir.is_dir():
        raise UsageError(f"--ckpt-dir {ckpt_dir} is a file: pass the run's checkpoint directory")


def _restore_mesh(ckpt_dir: pathlib.Path, step: int, cfg: RunConfig):
    """The mesh the checkpoint was saved on, if this process has the
    devices; else (parameters restore onto any mesh) its devices as one
    node. A LoRA run's frozen codes need the saved shape.

    Raises:
      UsageError: a LoRA run saved on more devices than this process has.
    """
    import jax

    from zpp_jax.checkpoint import Checkpointer
    from zpp_jax.mesh import make_mesh

    saved = Checkpointer.saved_mesh(ckpt_dir, step)
    n = math.prod(saved.values()) if saved else 0
    if saved and n <= jax.device_count():
        # A tensor-parallel run's checkpoint restores onto its devices
        # without the model axis: checkpoints restore onto any mesh.
        local = saved["local"] * saved.get("model", 1)
        return make_mesh(saved["node"], local, devices=jax.devices()[:n])
    if cfg.lora is not None:
        raise UsageError(
            f"this LoRA run stored its frozen base as codes for a mesh of {n} devices; restore it "
            f"on {n} devices (this process has {jax.device_count()}; on CPU, set "
            f"JAX_NUM_CPU_DEVICES={n})"
        )
    return make_mesh(1, jax.device_count())


def export_hf(
    ckpt_dir: str | pathlib.Path,
    out: str | pathlib.Path,
    *,
    step: int | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    merge_onto: str | None = None,
    base: str | pathlib.Path | None = None,
) -> list[pathlib.Path]:
    """Write checkpoint `step` (default: the newest) of the run in
    `ckpt_dir` as a Hugging Face checkpoint directory `out`, its weights in
    `dtype`; returns the files written, with the run's tokenizer.json and
    the initial checkpoint's other files (`COMPANION_FILES`: its chat
    template, special tokens, generation defaults). A LoRA run's adapters
    are merged into their kernels, ``kernel + scale * a @ b`` in fp32: with
    `merge_onto` "base" (the default), the kernels of the checkpoint the run started
    from (`base`, default where the run read it), so that a merge gives
    the base's own weights plus the update, as onto an unquantized base;
    with "codes", the kernels the run computed with (decoded from their
    codes): the trained model exactly. Every tensor no adapter wraps is the
    base's own either way. Memory: the whole model on the host, and with
    "base" the base checkpoint once more.

    Raises:
      UsageError: `out` not empty (without `overwrite`), a file, the run's
        own directory or the checkpoint it started from (with `overwrite`
        too), no checkpoint, a run with no config.json (a GPT), a
        token-pipeline run, with "base" a base checkpoint that is gone or is
        not the run's, or a `base` given with "codes", or `base` or
        `merge_onto` for a run that trained every weight.
    """
    import jax

    from zpp_jax import hf

    ckpt_dir, out = pathlib.Path(ckpt_dir), pathlib.Path(out)
    _check_export(ckpt_dir, out, dtype, overwrite)
    if merge_onto not in (None, "base", "codes"):
        raise UsageError(f"--merge-onto {merge_onto!r}: choose base or codes")
    if base is not None and merge_onto == "codes":
        raise UsageError(
            "--base is the checkpoint a merge onto the base reads, and --merge-onto codes reads "
            "none: drop one"
        )
    model, cfg, step = restore_run_model(ckpt_dir, step)
    given = "--base" if base is not None else "--merge-onto" if merge_onto else None
    if given and cfg.lora is None:
        raise UsageError(
            f"{given} says how a LoRA run's adapters are merged, and this run trained every "
            f"weight: drop {given}"
        )
    if cfg.lora is not None:
        from zpp_jax.lora import merge_lora
        from zpp_jax.sharded import unshard

        model = unshard(model)
        if merge_onto in (None, "base"):
            _onto_base_kernels(model, _base_directory(ckpt_dir, step, base))
        model = merge_lora(model)
    extra = _kept_config(ckpt_dir / CONFIG_FILE, dtype)
    written = hf.save(model, out, dtype=dtype, overwrite=overwrite, extra=extra)
    if jax.process_index() == 0:
        for name in ("tokenizer.json", *COMPANION_FILES):
            if (ckpt_dir / name).is_file():
                shutil.copyfile(ckpt_dir / name, out / name)
                written.append(out / name)
    return written


def _base_directory(ckpt_dir: pathlib.Path, step: int, base) -> pathlib.Path:
    """The LoRA run's --init checkpoint: `base`, or where the run read it;
    checked to be that checkpoint (its fingerprint)."""
    from zpp_jax.checkpoint import Checkpointer
    from zpp_jax.hf.files import fingerprint

    if base is not None and not (pathlib.Path(base) / CONFIG_FILE).is_file():
        raise UsageError(
            f"--base {base} is not a Hugging Face checkpoint's directory (no config.json there): "
            "pass the directory of the checkpoint the run started from"
        )
    base = _saved_base(ckpt_dir) if base is None else pathlib.Path(base)
    if base is None:
        raise UsageError(
            f"--ckpt-dir {ckpt_dir} does not say where its base checkpoint is: pass --base "
            "DIR, or --merge-onto codes"
        )
    if not (base / CONFIG_FILE).is_file():
        raise UsageError(
            f"the run's base checkpoint {base} is gone: pass --base DIR where it is now, or "
            "--merge-onto codes to merge onto the codes the run computed with"
        )
    if fingerprint(base) != Checkpointer(ckpt_dir).read_meta(step)["identity"].get("init"):
        raise UsageError(
            f"{base} is not the checkpoint this run started from (its fingerprint differs): "
            "pass --base DIR of that one, or --merge-onto codes"
        )
    return base


def _onto_base_kernels(model, base: pathlib.Path) -> None:
    """Put the base checkpoint's own kernels under `model`'s adapters (a
    plain LoRA model; in place)."""
    from flax import nnx

    from zpp_jax import hf
    from zpp_jax.frozen import adapted_kernels
    from zpp_jax.paths import node_at

    original = dict(nnx.to_flat_state(nnx.state(hf.load(base), nnx.Param)))
    for path in adapted_kernels(model):
        kernel = original[tuple(k for k in path if k != "base_module")].get_value()
        node_at(model, path[:-1]).kernel = nnx.Param(kernel)


def _check_export(ckpt_dir: pathlib.Path, out: pathlib.Path, dtype: str, overwrite: bool) -> None:
    from zpp_jax.hf.files import DTYPES

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}")
    check_run_directory(ckpt_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--hf {out} is a file: name the directory to write")
    kept = ((ckpt_dir, "the run's --ckpt-dir"), (_saved_base(ckpt_dir), "the run's --init"))
    for directory, what in kept:
        if directory is not None and out.resolve() == directory.resolve():
            raise UsageError(
                f"--hf {out} is {what}, which --overwrite does not replace: write the export "
                "into another directory"
            )
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UsageError(
            f"--hf {out} is not empty: write into a new directory, or pass --overwrite"
        )
    if not (ckpt_dir / CONFIG_FILE).is_file():
        raise UsageError(
            f"--ckpt-dir {ckpt_dir} has no {CONFIG_FILE}: zpp export --hf writes Llama-family "
            "models, which runs with --init or --arch llama keep there (a GPT has none)"
        )


def _saved_base(ckpt_dir: pathlib.Path) -> pathlib.Path | None:
    """Where the run read its --init checkpoint (None: it started from
    none, or does not say)."""
    from zpp_jax.recipes.runs import BASE_FILE

    saved = ckpt_dir / BASE_FILE
    return pathlib.Path(json.loads(saved.read_text())["init"]) if saved.is_file() else None


def _kept_config(config_file: pathlib.Path, dtype: str) -> dict:
    """The run's config.json (the checkpoint's it started from), carried
    whole into the export's: its positions and rotary scaling, token ids
    and every field the model does not read; only the dtype is the
    export's. The model was built from it, so the sizes agree."""
    data = json.loads(config_file.read_text())
    data["torch_dtype"] = dtype
    if "dtype" in data:  # transformers 5.x's name for it
        data["dtype"] = dtype
    return data
