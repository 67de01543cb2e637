"""Compiling for GPUs that are not here: a mesh of devices that exist only
as a compile target.

`target_mesh(nodes, local)` describes `nodes` hosts of `local` GPUs each
from an XLA GPU target description (a ``.txtpb`` ``GpuTargetConfigProto``,
e.g. XLA's ``xla/backends/gpu/target_config/specs/h200.txtpb``) and builds
the (`node`, `local`) mesh over them. A model built with
``nnx.eval_shape`` and a `Trainer` on that mesh compile their step
(``trainer.compile_step``) to the GPU's optimized, scheduled program with
its Triton kernels through ptxas, and its memory analysis; nothing runs.

Needs a CUDA plugin (``pip install "zpp-jax[gpu-aot]"``) and, on a
machine without a GPU, ``JAX_PLATFORMS=cpu`` (the plugin cannot start
without a GPU; the compile-only client does not need one).
"""

from __future__ import annotations

import os
from pathlib import Path

from jax.sharding import Mesh

from zpp_jax.errors import UsageError

TARGET_CONFIG_ENV = "ZPP_GPU_TARGET_CONFIG"
SPEC_URL = (
    "https://raw.githubusercontent.com/openxla/xla/main/"
    "xla/backends/gpu/target_config/specs/h200.txtpb"
)
# Fields of newer target descriptions that this XLA does not parse.
_UNPARSED = ("collective_memory_granularity",)


# JAX's CUDA plugins, by the CUDA major version they are built for.
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def has_cuda_plugin() -> bool:
    """Whether one of JAX's CUDA plugins (CUDA 13 or 12) is installed (it
    need not find a GPU)."""
    import importlib.util

    try:
        return any(importlib.util.find_spec(p) is not None for p in _CUDA_PLUGINS)
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def target_config(path: str | os.PathLike | None = None) -> str:
    """The text of a GPU target description: `path`, else the file named by
    the ``ZPP_GPU_TARGET_CONFIG`` environment variable, with the fields this
    XLA does not parse removed."""
    path = path or os.environ.get(TARGET_CONFIG_ENV)
    if not path:
        raise UsageError(
            f"no GPU target description: set {TARGET_CONFIG_ENV} to a .txtpb file "
            f"such as XLA's H200 description ({SPEC_URL})"
        )
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"GPU target description {file} does not exist ({TARGET_CONFIG_ENV})")
    lines = file.read_text().splitlines()
    text = "\n".join(x for x in lines if not x.strip().startswith(_UNPARSED))
    if "gpu_device_info" not in text:
        raise UsageError(f"{file} is not an XLA GPU target description (no gpu_device_info)")
    return text


def device_memory_bytes(config_path: str | os.PathLike | None = None) -> int:
    """One GPU's memory in bytes, as `target_config(config_path)` gives it
    (``gpu_device_info.device_memory_size``): what a compiled step's peak
    must fit in."""
    import re

    found = re.search(r"device_memory_size:\s*(\d+)", target_config(config_path))
    if found is None:
        raise UsageError("the GPU target description gives no device_memory_size")
    return int(found.group(1))


def target_mesh(
    nodes: int, local: int, config_path: str | os.PathLike | None = None, model: int = 1
) -> Mesh:
    """The (`node`, `local`) mesh over `nodes` x `local` GPUs described by
    `target_config(config_path)`, for compiling only; with ``model > 1`` the
    (`node`, `local` / model, `model`) mesh of tensor parallelism."""
    if not has_cuda_plugin():
        raise UsageError(
            'compiling for a GPU needs JAX\'s CUDA plugin: pip install "zpp-jax[gpu-aot]"'
        )
    from jax.experimental import topologies

    from zpp_jax.mesh import make_mesh

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(config_path), topology=f"1x{nodes}x{local}"
        )
    except RuntimeError as e:
        raise UsageError(
            f"the CUDA plugin could not describe {nodes} x {local} GPUs ({e}); on a machine "
            "without a GPU run with JAX_PLATFORMS=cpu"
        ) from e
    return make_mesh(nodes, local // model, devices=topo.devices, model=model)
