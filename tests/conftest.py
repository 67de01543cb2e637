"""Shared set-up: 8 emulated CPU devices, fast compiles, meshes.

The environment below is set before jax is imported anywhere in the session,
and the subprocesses tests start (`zpp train`, `zpp launch`, examples)
inherit it.
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the session, so that a subprocess compiling the
# same program as an earlier one (a resumed run, the second node of a launch)
# loads it instead. A fresh directory each session, made by the process that
# starts it; the pytest-xdist workers inherit it, so that a program one worker
# compiled is loaded by the other. Nothing carries over between runs.
_PREFIX = "zpp-jax-tests-"
_inherited = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
_OWNER = not os.path.basename(_inherited).startswith(_PREFIX)
_CACHE = tempfile.mkdtemp(prefix=_PREFIX) if _OWNER else _inherited
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
# Every program is written, the small ones too: a subprocess (`zpp train`,
# a launched node, a README block) compiles some fifty small programs of
# its own besides its step (initializers, the optimizer's set-up, the
# metrics), the same in every one of them.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# Importing jax reads no XLA flag: XLA reads XLA_FLAGS when the first
# backend starts, below.
from zpp_jax._compat import known_xla_flags  # noqa: E402

# The suite compiles hundreds of small programs, where XLA:CPU's code
# generation costs far more than the programs take to run: LLVM without
# optimizations. The numbers are IEEE arithmetic either way, and the
# collectives and buffers the tests read are the same. XLA aborts a process
# whose XLA_FLAGS names a flag its jaxlib lacks, so the session's first
# process asks this jaxlib which it knows, sets those, and leaves the rest
# out with a note in the report's header; the workers and the subprocesses
# inherit what it set.
_FAST_COMPILE = ("--xla_backend_optimization_level=0",)
_LEFT_OUT = "ZPP_TESTS_XLA_FLAGS_LEFT_OUT"
if _OWNER:
    _given = os.environ.get("XLA_FLAGS", "")
    _kept, _lacking = known_xla_flags(f for f in _FAST_COMPILE if f.split("=")[0] not in _given)
    os.environ["XLA_FLAGS"] = " ".join([*_given.split(), *_kept])
    os.environ[_LEFT_OUT] = " ".join(_lacking)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from zpp_jax import make_mesh  # noqa: E402

# The longest files, longest first: with `--dist loadfile` a file runs on
# one worker, and a long file started last would leave the other worker
# idle at the end of the session. (Measured: the sum of each file's test
# durations; the others follow in collection order.)
_LONGEST_FIRST = (
    "test_runs.py",
    "test_shard.py",
    "test_layer.py",
    "test_train.py",
    "test_pipeline_train.py",
    "test_shard_convergence.py",
    "test_multihost.py",
    "test_readme.py",
    "test_pipeline_runtime.py",
    "test_examples.py",
    "test_comm.py",
    "test_adoption.py",
)


def pytest_report_header(config):
    lacking = os.environ.get(_LEFT_OUT)
    if lacking:
        return f"XLA flags left out, this jaxlib lacks them: {lacking}"
    return None


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(_CACHE, ignore_errors=True)


# The transposed mesh (4 nodes of 2) in the slow set: the quick loop runs 2 x 4.
@pytest.fixture(
    scope="session",
    params=[(2, 4), pytest.param((4, 2), marks=pytest.mark.slow)],
    ids=["2x4", "4x2"],
)
def mesh(request):
    return make_mesh(*request.param)


@pytest.fixture(scope="session")
def mesh24():
    return make_mesh(2, 4)
