"""A unit's arguments and results as the model's author wrote them: any
nesting of dicts, lists, tuples, dataclasses and `None`, with arrays and
non-array leaves (ints, bools, strings, enums) side by side.

A unit's call crosses a `jax.shard_map`, which takes pytrees of arrays
only. `open_tree` makes any such value one: a dataclass that is not a
registered pytree becomes an `Opened` node of its fields, and a non-array
leaf a `Static` node with no leaves, its value carried as static data (the
same on every device: it was fixed when the call was traced). `close_tree`
undoes both. `write_back` carries what a unit's code wrote into a Python
container passed to it (``acts[name] = x``) back into the caller's.

Costs nothing at run time: all of it happens while the call is traced.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from jax.tree_util import GetAttrKey, register_pytree_with_keys_class

from zpp_jax._compat import is_tracer
from zpp_jax.errors import UsageError


class _Original:
    """A dataclass instance held by identity (it need not be hashable)."""

    def __init__(self, value: Any) -> None:
        self.value = value


@register_pytree_with_keys_class
class Opened:
    """A dataclass that is not a pytree, as a pytree of its fields."""

    def __init__(self, original: _Original, fields: dict) -> None:
        self.original, self.fields = original, fields

    def tree_flatten_with_keys(self):
        children = [(GetAttrKey(k), v) for k, v in self.fields.items()]
        return children, (self.original, tuple(self.fields))

    @classmethod
    def tree_unflatten(cls, aux, children) -> Opened:
        return cls(aux[0], dict(zip(aux[1], children, strict=True)))

    def close(self) -> Any:
        """A copy of the original with these fields (frozen ones too)."""
        out = copy.copy(self.original.value)
        for name, value in self.fields.items():
            object.__setattr__(out, name, close_tree(value))
        return out


@register_pytree_with_keys_class
class Static:
    """A non-array leaf, as a pytree node with no leaves."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def tree_flatten_with_keys(self):
        return [], self.value

    @classmethod
    def tree_unflatten(cls, aux, children) -> Static:
        return cls(aux)


def _is_pytree_leaf(x) -> bool:
    """Whether JAX sees `x` as one leaf (not a registered pytree node)."""
    leaves = jax.tree.leaves(x)
    return len(leaves) == 1 and leaves[0] is x


def _is_plain_dataclass(x) -> bool:
    if not dataclasses.is_dataclass(x) or isinstance(x, type | nn.Module):
        return False
    return _is_pytree_leaf(x)


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) or is_tracer(x)


def _keeps(x) -> bool:
    """What `open_tree` leaves as it is: arrays, NNX objects and variables,
    Linen modules (their variables live in scopes, not in them)."""
    return _is_array(x) or isinstance(x, nnx.Variable | nnx.Pytree | nn.Module)


def open_tree(tree: Any, where: str, statics: bool = False) -> Any:
    """`tree` with every plain dataclass `Opened` and (with `statics`) every
    non-array leaf `Static`; containers holding neither are kept as they
    are (the caller's own objects). `where` names `tree` for messages.

    Raises:
      UsageError: an object that is neither a pytree nor a dataclass holds
        arrays (they would be baked into the call as constants).
    """

    def visit(x, path: str):
        if _keeps(x) or x is None:
            return x
        if _is_plain_dataclass(x):
            fields = {f.name: visit(getattr(x, f.name), f"{path}.{f.name}") for f in _fields(x)}
            return Opened(_Original(x), fields)
        if isinstance(x, dict):
            new = {k: visit(v, f"{path}[{k!r}]") for k, v in x.items()}
            if all(new[k] is x[k] for k in x):
                return x
            out = copy.copy(x)  # its own class (an OrderedDict, a defaultdict)
            out.update(new)
            return out
        if isinstance(x, list | tuple) and not hasattr(x, "_fields"):
            new = [visit(v, f"{path}[{i}]") for i, v in enumerate(x)]
            if all(a is b for a, b in zip(new, x, strict=True)):
                return x
            return type(x)(new)
        if not _is_pytree_leaf(x):  # a registered pytree: its own children
            leaves, treedef = jax.tree.flatten(x)
            return jax.tree.unflatten(treedef, [visit(v, path) for v in leaves])
        _refuse_hidden_arrays(x, path)
        return Static(x) if statics else x

    return visit(tree, where)


def open_call(args: tuple, kwargs: dict, unit: str) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of `unit`, `open_tree`'d (statics kept
    as they are: NNX keeps them in the graph definition)."""
    opened = tuple(
        open_tree(a, f"unit {unit}'s positional argument {i}") for i, a in enumerate(args)
    )
    named = {k: open_tree(v, f"unit {unit}'s keyword argument {k!r}") for k, v in kwargs.items()}
    same = all(a is b for a, b in zip(opened, args, strict=True))
    same = same and all(named[k] is kwargs[k] for k in kwargs)
    return (args, kwargs) if same else (opened, named)


def _fields(x) -> list:
    return [f for f in dataclasses.fields(x) if hasattr(x, f.name)]


def _refuse_hidden_arrays(x, path: str) -> None:
    held = getattr(x, "__dict__", None)
    if held and any(_is_array(v) for v in jax.tree.leaves(dict(held))):
        raise UsageError(
            f"{path} is a {type(x).__name__} holding arrays, which is not a pytree: its arrays "
            "would be fixed into the unit's call as constants. Make it a dataclass, or register "
            "it (flax.struct.dataclass, jax.tree_util.register_dataclass)"
        )


def static_leaves(tree: Any) -> dict[str, Any]:
    """Every non-array leaf of `tree` by its key path: what a unit's code
    may not write into its arguments (only arrays travel back)."""
    opened = open_tree(tree, "the arguments", statics=True)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        opened, is_leaf=lambda x: isinstance(x, Static) or _keeps(x)
    )
    return {jax.tree_util.keystr(p): x.value for p, x in flat if isinstance(x, Static)}


def changed_statics(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The key paths of `after` that are new or hold another value."""
    return [k for k, v in after.items() if k not in before or not _same(before[k], v)]


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an __eq__ that does not give a bool: not the same
        return False


def close_tree(tree: Any) -> Any:
    """`tree` as `open_tree` found it (copies of its dataclasses)."""

    def close(x):
        return x.close() if isinstance(x, Opened) else x.value if isinstance(x, Static) else x

    # NNX objects are kept as they are: their identity is what NNX tracks.
    return jax.tree.map(close, tree, is_leaf=lambda x: isinstance(x, Opened | Static) or _keeps(x))


def write_back(caller: Any, written: dict, unit: str) -> None:
    """Put each value of `written` (NNX path in ``(args, kwargs)`` -> value)
    where the unit's code wrote it, in the caller's containers: a dict's
    key, a list's item (or the next one: an append), an object's attribute.

    Raises:
      UsageError: the path passes through something that cannot be written
        (a tuple, a new container the caller does not hold).
    """
    for path, value in sorted(written.items(), key=lambda kv: len(kv[0])):
        parent = caller
        for key in path[:-1]:
            parent = _child(parent, key, path, unit)
        _set(parent, path[-1], close_tree(value), path, unit)


def _child(parent, key, path, unit: str):
    try:
        if isinstance(parent, dict | list | tuple):
            return parent[key]
        return getattr(parent, key)
    except (KeyError, IndexError, AttributeError, TypeError):
        raise UsageError(_unwritable(path, unit)) from None


def _set(parent, key, value, path, unit: str) -> None:
    if isinstance(parent, dict):
        parent[key] = value
    elif isinstance(parent, list) and isinstance(key, int) and key <= len(parent):
        parent.append(value) if key == len(parent) else parent.__setitem__(key, value)
    elif dataclasses.is_dataclass(parent) or hasattr(parent, "__dict__"):
        object.__setattr__(parent, key, value)
    else:
        raise UsageError(_unwritable(path, unit))


def describe(path: tuple) -> str:
    """An NNX path in a call's ``(args, kwargs)``, as the caller wrote it."""
    rest = "".join(f"[{k!r}]" for k in path[2:])
    if path[0] == 0:
        return f"positional argument {path[1]}{rest}"
    return f"keyword argument {path[1]!r}{rest}"


def _unwritable(path, unit: str) -> str:
    return (
        f"unit {unit} wrote {describe(path)} in its call, and zpp cannot write it back into "
        "the caller's arguments (it passes through a tuple or an object the caller does not "
        "hold): return the value from the unit instead, or write into a dict or list that "
        "the caller passed in"
    )


def with_values(items, values) -> nnx.State:
    """A flat state's items with new values (variables keep their type)."""
    return nnx.from_flat_state(
        [
            (p, v.replace(x) if isinstance(v, nnx.Variable) else x)
            for (p, v), x in zip(items, values, strict=True)
        ]
    )
