"""The map of the code holds: data flows one way, each concern in its place.

Read from the source (no import runs): every `import` of the package,
function-level ones included, the sizes of modules and functions, and the
declared JAX range.
"""

import ast
import importlib.metadata
import pathlib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zpp_jax"
# The engine: its core, its ordering and its seam to JAX.
ENGINE = (
    "zpp_jax.config",
    "zpp_jax.mesh",
    "zpp_jax.quant",
    "zpp_jax.partition",
    "zpp_jax.collectives",
    "zpp_jax.layer",
    "zpp_jax.unit",
    "zpp_jax.pytrees",
    "zpp_jax.on_device",
    "zpp_jax.metadata",
    "zpp_jax.residuals",
    "zpp_jax.shard",
    "zpp_jax.shard_linen",
    "zpp_jax.sharded",
    "zpp_jax.outputs",
    "zpp_jax.wire",
    "zpp_jax.overlap",
    "zpp_jax._compat",
)
ABOVE_THE_ENGINE = (
    "zpp_jax.analysis",
    "zpp_jax.recipes",
    "zpp_jax.cli",
    "zpp_jax.models",
    "zpp_jax.train",
    "zpp_jax.pipeline",
)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    found = set()
    package = _module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_circle():
    edges = _graph()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                raise AssertionError(" -> ".join([*path[path.index(d) :], d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])


def test_the_engine_imports_nothing_above_it():
    wrong = {
        m: sorted(d for d in deps if _within(d, ABOVE_THE_ENGINE))
        for m, deps in _graph().items()
        if _within(m, ENGINE)
    }
    assert {m: d for m, d in wrong.items() if d} == {}


def test_only_the_layers_above_it_import_analysis():
    """The engine and the training programs (`program`, `train`,
    `baseline`, `checkpoint`) never import `zpp_jax.analysis`: it reads
    what they compile."""
    above = ("zpp_jax.analysis", "zpp_jax.recipes", "zpp_jax.cli", "zpp_jax")
    importers = {
        name
        for name, imported in _graph().items()
        if any(m == "zpp_jax.analysis" or m.startswith("zpp_jax.analysis.") for m in imported)
    }
    assert {n for n in importers if not n.startswith(above[:3]) and n != above[3]} == set()


def test_private_jax_only_through_the_seam():
    users = {
        _module_name(p)
        for p in PACKAGE.rglob("*.py")
        if any(m.startswith("jax._src") for m in _imports(p))
    }
    assert users <= {"zpp_jax._compat"}


def test_examples_and_benchmarks_do_not_import_the_cli():
    users = [
        str(p.relative_to(ROOT))
        for folder in ("examples", "benchmarks")
        for p in (ROOT / folder).rglob("*.py")
        if any(_within(m, ("zpp_jax.cli",)) for m in _imports(p))
    ]
    assert users == []


def test_the_pipeline_imports_no_model():
    wrong = [
        m
        for m, deps in _graph().items()
        if _within(m, ("zpp_jax.pipeline",)) and any(_within(d, ("zpp_jax.models",)) for d in deps)
    ]
    assert wrong == []


def test_engine_modules_and_functions_stay_short():
    long_modules = {
        _module_name(p): n
        for p in PACKAGE.rglob("*.py")
        if _within(_module_name(p), ENGINE) and (n := len(p.read_text().splitlines())) > 500
    }
    assert long_modules == {}
    long_functions = []
    for p in [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(ROOT / "examples").rglob("*.py"),
    ]:
        rel = str(p.relative_to(ROOT))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long_functions.append((rel, node.name, lines))
    assert long_functions == []


@pytest.mark.parametrize("name", ["jax", "jaxlib"])
def test_ci_runs_the_quick_loop_on_the_oldest_jax_declared(name):
    """`.ci/run` installs the pins of `.ci/oldest.txt` for its second run:
    they are the declared range's lowest versions (the whole suite runs on
    the newest the index serves; `tests/test_compat.py` checks both)."""
    (spec,) = [
        Requirement(r).specifier
        for r in importlib.metadata.requires("zpp-jax")
        if Requirement(r).name == name and not Requirement(r).marker
    ]
    lowest = min((s for s in spec if s.operator == ">="), key=lambda s: s.version)
    pins = [
        Requirement(line)
        for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert [str(p.specifier) for p in pins if p.name == name] == [f"=={lowest.version}"]
    assert "-c .ci/oldest.txt" in (ROOT / ".ci" / "run").read_text()
