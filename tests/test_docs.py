"""The API reference (docs/api/*.md, rendered by mkdocstrings) covers every
public name, and every public name says what it does."""

import inspect
import pathlib
import re

import pytest

import zpp_jax
import zpp_jax.analysis
import zpp_jax.baseline
import zpp_jax.data
import zpp_jax.distributed
import zpp_jax.frozen
import zpp_jax.hf
import zpp_jax.lora
import zpp_jax.lowlevel
import zpp_jax.overlap
import zpp_jax.sharded
import zpp_jax.train

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "api").glob("*.md")))
DIRECTIVES = set(re.findall(r"^::: ([\w.]+)$", API, flags=re.M))
# Constants have no docstring of their own: the reference describes them in prose.
CONSTANTS = {"AXES", "NODE", "LOCAL", "STAGE", "FROZEN", "DEFAULT_TARGETS"}


# Submodules whose __all__ is public API, and the public names of the others.
MODULES = (
    zpp_jax,
    zpp_jax.lowlevel,
    zpp_jax.data,
    zpp_jax.analysis,
    zpp_jax.hf,
    zpp_jax.lora,
    zpp_jax.frozen,
)
NAMES = {
    zpp_jax.train: ("next_token_loss", "cross_entropy"),
    zpp_jax.sharded: ("grad",),
    zpp_jax.overlap: ("overlap_options",),
    zpp_jax.distributed: ("initialize", "DistributedConfig"),
    zpp_jax.baseline: ("JitFSDP", "NoCommunication", "fsdp_sharding", "param_shardings"),
}


def _public():
    """(qualified name, object) of every public name: the top level's and
    the public submodules' that hold a user's API."""
    out = []
    listed = [(m, m.__all__) for m in MODULES] + list(NAMES.items())
    for module, names in listed:
        for name in names:
            obj = getattr(module, name)
            if not inspect.ismodule(obj):
                out.append((f"{module.__name__}.{name}", obj))
    return out


PUBLIC = _public()


@pytest.mark.parametrize("qualified, obj", PUBLIC, ids=[q for q, _ in PUBLIC])
def test_every_public_name_is_documented(qualified, obj):
    name = qualified.rsplit(".", 1)[1]
    if name in CONSTANTS:
        assert f"`{qualified}`" in API, qualified
        return
    assert (inspect.getdoc(obj) or "").strip(), f"{qualified} has no docstring"
    rendered = {d for d in DIRECTIVES if d.endswith(f".{name}")}
    assert rendered, f"{qualified} is in no docs/api page (add '::: module.{name}')"


def test_every_directive_names_a_public_object():
    """No page documents something that is not (or no longer) public."""
    public = {id(obj) for _, obj in PUBLIC}
    for directive in DIRECTIVES:
        module, name = directive.rsplit(".", 1)
        obj = getattr(__import__(module, fromlist=[name]), name)
        assert id(obj) in public, directive


def test_the_top_level_is_a_users_api():
    """At most 15 names; a former top-level name still resolves, with a
    DeprecationWarning naming where it lives now."""
    assert len(zpp_jax.__all__) <= 15, zpp_jax.__all__
    with pytest.warns(DeprecationWarning, match="use zpp_jax.data.TokenDataset"):
        assert zpp_jax.TokenDataset is zpp_jax.data.TokenDataset
    with pytest.warns(DeprecationWarning, match="use zpp_jax.lowlevel.to_primary_shards"):
        assert zpp_jax.shard_params is zpp_jax.lowlevel.to_primary_shards


def test_the_adoption_page_and_its_tests_name_each_other():
    """docs/guide/adoption.md names every test of tests/test_adoption.py,
    and every test it names exists there."""
    page = (ROOT / "docs" / "guide" / "adoption.md").read_text()
    source = (ROOT / "tests" / "test_adoption.py").read_text()
    tests = set(re.findall(r"^def (test_\w+)", source, flags=re.M))
    named = set(re.findall(r"`(test_\w+)`", page))
    assert tests == named, (sorted(tests - named), sorted(named - tests))
