"""The package's public names, and what importing it costs."""

import subprocess
import sys

import pytest

import zpp_jax
import zpp_jax.pipeline


@pytest.mark.parametrize("package", [zpp_jax, zpp_jax.pipeline], ids=lambda p: p.__name__)
def test_every_public_name_resolves(package):
    """Names are imported on first use: each one in `__all__` resolves, is
    listed by dir(), and an unknown one is an AttributeError."""
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope  # noqa: B018


def test_planning_does_not_import_jax():
    """`zpp plan` (and the planner's Python API) run on NumPy alone, so a
    plan costs no JAX start-up."""
    code = (
        "import sys\n"
        "from zpp_jax.cli import main\n"
        "assert main(['plan', '--layers', '8', '--hidden', '64', '--seq', '64', "
        "'--stages', '2']) == 0\n"
        "import zpp_jax, zpp_jax.pipeline as p\n"
        "p.plan_tokens(64, 2, p.AnalyticCost(hidden=64, layers=4))\n"
        "assert zpp_jax.ZeroPPConfig().hpz\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
