"""A run's checkpoint directory and metrics as they were when it stopped
after one of its checkpoints, made from a run that went on: what a resumed
run starts from, without training that prefix a second time."""

import json
import pathlib
import shutil


def copy_stopped_after(step, ckpt, metrics, to_ckpt, to_metrics):
    """Copy `ckpt` to `to_ckpt` without the checkpoints after `step`, and
    the records of `metrics` up to `step` to `to_metrics`."""
    ckpt, to_ckpt = pathlib.Path(ckpt), pathlib.Path(to_ckpt)
    assert (ckpt / str(step)).is_dir(), f"no checkpoint {step} in {ckpt}"
    shutil.copytree(ckpt, to_ckpt)
    for later in to_ckpt.iterdir():
        if later.name.isdigit() and int(later.name) > step:
            shutil.rmtree(later)
    lines = pathlib.Path(metrics).read_text().splitlines(keepends=True)
    pathlib.Path(to_metrics).write_text("".join(x for x in lines if json.loads(x)["step"] <= step))
