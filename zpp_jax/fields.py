"""Each setting defined once: a dataclass field with its default, its help
text and its validation, from which the command line is generated.

`option(default, help, ...)` is a dataclass field that carries a `Flag`:
its help, its argparse type (a `zpp_jax.errors.Number` also checks the
range from Python), its choices, and its spelling on the command line.
`add_flags` writes a dataclass's flags into an argparse parser,
`given_flags` reads back the ones a command line gave, and `check_flags`
checks a dataclass's values against the same types and choices, so that
``RunConfig(steps=-1)`` and ``zpp train --steps -1`` are refused alike.

Importing this module costs no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from zpp_jax.errors import Number, UsageError


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one dataclass field appears on the command line.

    help: what it means (the default is added to it).
    type: parses the flag's text; a `Number` also bounds the value.
    choices: the values it takes.
    name: the flag (default ``--field-name``).
    negate: a switch that turns a True field off (``--no-hpz``, ``--quiet``).
    group: the heading it is listed under in ``--help``.
    """

    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple | None = None
    name: str | None = None
    negate: bool = False
    group: str | None = None


def option(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field with `default` and the `Flag` made of `help` and
    `flag`'s entries."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


def flags_of(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of dataclass `cls` that have a flag, in definition order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def flag_name(field: dataclasses.Field) -> str:
    """How the command line spells `field` (``--seq`` for `seq_len`)."""
    flag = field.metadata.get("flag")
    return (flag and flag.name) or "--" + field.name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser, defaults: Any, skip: tuple = (), only: tuple | None = None
) -> dict:
    """Add a flag per field of `defaults`' dataclass that has one (but those
    named in `skip`; with `only`, just those named there), the help saying
    `defaults`' value. A flag not given leaves its field unset in the parsed
    namespace (`given_flags`). Returns the argument groups made, by heading."""
    groups: dict[str, Any] = {}
    for field, flag in flags_of(type(defaults)):
        if field.name in skip or (only is not None and field.name not in only):
            continue
        target = parser
        if flag.group:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            target = groups[flag.group]
        target.add_argument(flag_name(field), **_argparse_keywords(field, flag, defaults))
    return groups


def _argparse_keywords(field: dataclasses.Field, flag: Flag, defaults: Any) -> dict:
    default = getattr(defaults, field.name)
    keywords = {"dest": field.name, "default": argparse.SUPPRESS}
    if isinstance(default, bool):
        keywords["action"] = "store_false" if flag.negate else "store_true"
        keywords["help"] = flag.help.replace("%", "%%")
        return keywords
    keywords["metavar"] = flag_name(field).lstrip("-").replace("-", "_").upper()
    if flag.type is not None:
        keywords["type"] = flag.type
    if flag.choices is not None:
        keywords["choices"] = flag.choices
        del keywords["metavar"]
        if None in flag.choices:  # spelled as the command line takes it
            shown = ",".join("none" if c is None else str(c) for c in flag.choices)
            keywords["metavar"] = "{" + shown + "}"
    shown = "" if default is None else f" (default {default})"
    keywords["help"] = (flag.help + shown).replace("%", "%%")
    return keywords


def given_flags(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` whose flags `args` (parsed with `add_flags`) holds."""
    return {f.name: getattr(args, f.name) for f, _ in flags_of(cls) if hasattr(args, f.name)}


def check_flags(obj: Any) -> None:
    """Raise UsageError, naming the flag, for a field of dataclass `obj`
    outside its flag's range (`Number`) or choices. None passes where it is
    the field's default (a setting left to something else)."""
    for field, flag in flags_of(type(obj)):
        value = getattr(obj, field.name)
        if value is None and field.default is None:
            continue
        if isinstance(flag.type, Number):
            flag.type.check(flag_name(field), value)
        if flag.choices is not None and value not in flag.choices:
            raise UsageError(
                f"{flag_name(field)} {value!r} is not supported; choose one of {flag.choices}"
            )
