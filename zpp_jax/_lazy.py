"""Package attributes imported on first use (PEP 562), so that importing a
package does not import JAX until something that needs it is touched."""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Callable


class _Package(types.ModuleType):
    """A package whose public names may equal its submodules' names
    (`zpp_jax.shard` the function, defined in `zpp_jax.shard` the module).
    Importing such a submodule binds it on the package; the public name keeps
    the function, as an eager ``from .shard import shard`` would."""

    _exports: dict[str, str]

    def __setattr__(self, name: str, value) -> None:
        if (
            isinstance(value, types.ModuleType)
            and self._exports.get(name) == value.__name__ == f"{self.__name__}.{name}"
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(
    package: str,
    exports: dict[str, str],
    submodules: tuple[str, ...] = (),
    moved: dict[str, str] | None = None,
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for `package`: `exports`
    maps a public name to the module that defines it; `submodules` are
    returned as modules (attributes, not part of ``__all__``). `moved` maps
    a former public name to where it lives now (``"module.name"``): it
    still resolves, with a DeprecationWarning that says where to import it
    from."""
    moved = moved or {}
    module = sys.modules[package]
    module.__class__ = _Package
    module._exports = exports
    public = sorted(exports)

    def __getattr__(name: str):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        if name in moved:
            where, new = moved[name].rsplit(".", 1)
            warnings.warn(
                f"{package}.{name} is deprecated and will be removed: use {where}.{new}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(where), new)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(module, name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*module.__dict__, *public, *submodules} - {"_exports"})

    return __getattr__, __dir__, public
