"""Paths in a module graph, as `nnx.iter_modules` and `nnx.to_flat_state`
give them: the node at a path, and a variable put at one.

A path's keys are attribute names, and indices or keys into the containers
a module holds (`nnx.List`, `nnx.Dict`, lists, tuples, dicts).
"""

from __future__ import annotations

from flax import nnx


def is_container(node) -> bool:
    """Whether `node` is indexed by a path's key rather than read by name."""
    return isinstance(node, nnx.List | nnx.Dict | list | tuple | dict)


def node_at(module, path: tuple):
    """The node at `path` below `module` (`module` itself for ``()``)."""
    node = module
    for key in path:
        node = node[key] if is_container(node) else getattr(node, key)
    return node


def set_at(module, path: tuple, value) -> None:
    """Put `value` at `path` below `module`, in place of what is there."""
    owner = node_at(module, path[:-1])
    if is_container(owner):
        owner[path[-1]] = value
    else:
        setattr(owner, path[-1], value)
