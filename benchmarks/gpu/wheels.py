"""The wheels the lent GPU machine lacks, downloaded here for its Python 3.12
(manylinux, x86-64) into a folder that the device tool's `run` carries
(64 MiB a call at most).

The machine has no network. Its image holds jax, jaxlib and the CUDA 13
plugin 0.11.2 and most of what zpp-jax needs (`MACHINE_HAS`, its package list
as the device tool's KINDS.md gives it); zpp-jax itself travels as the
working tree. What else it needs travels as wheels: its requirements that
the machine lacks, and theirs, found from each wheel's own metadata, plus
any package named with ``--also`` (a newer version of one the machine has).

    python benchmarks/gpu/wheels.py [--dir .whl] [--also NAME ...]

and on the machine, before the script (the run's command, `carry: [".whl"]`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
"""

import argparse
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LIMIT_MIB = 64
# The image's Python packages (KINDS.md, read on 2026-11-17), by name, blank-separated.
MACHINE_HAS = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"""
# pip matches a manylinux tag exactly: the ones wheels on the index carry.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64", "any"]
# The machine's environment, for the requirements' markers.
MACHINE = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "extra": "",
}


def download(requirement: Requirement, folder: Path) -> Path:
    """The one wheel pip picks for `requirement` on the machine."""
    before = set(folder.glob("*.whl"))
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", "3.12", "--implementation", "cp", *platforms]
        + ["-d", str(folder), str(requirement)],
        check=True,
    )
    new = set(folder.glob("*.whl")) - before
    name = canonicalize_name(requirement.name)
    (wheel,) = new or [w for w in before if canonicalize_name(w.name.split("-")[0]) == name]
    return wheel


def requirements_of(wheel: Path) -> list[Requirement]:
    """What `wheel` requires on the machine (its METADATA's Requires-Dist,
    markers evaluated there, extras left out)."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(z.read(meta).decode())
    found = [Requirement(r) for r in fields.get_all("Requires-Dist") or []]
    return [r for r in found if r.marker is None or r.marker.evaluate(MACHINE)]


def missing(also: list[str], folder: Path) -> list[Path]:
    """Download what the machine lacks of zpp-jax's requirements, theirs,
    and `also`; returns the wheels."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        queue = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
    queue += [Requirement(name) for name in also]
    has = {canonicalize_name(n) for n in MACHINE_HAS.split()}
    forced = {canonicalize_name(n) for n in also}
    wheels, seen = [], set()
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in seen or (name in has and name not in forced):
            continue
        seen.add(name)
        wheel = download(req, folder)
        print(f"{wheel.name:70s} {wheel.stat().st_size / 2**20:6.1f} MiB")
        wheels.append(wheel)
        queue += requirements_of(wheel)
    return wheels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".whl")
    parser.add_argument(
        "--also", nargs="*", default=[], help="packages to carry although the machine has them"
    )
    args = parser.parse_args()
    args.dir.mkdir(exist_ok=True)
    wheels = missing(args.also, args.dir)
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {total:.1f} MiB in {args.dir} (a call carries {LIMIT_MIB} MiB)")
    return 0 if total < LIMIT_MIB else 1


if __name__ == "__main__":
    sys.exit(main())
