"""The exception types for bad input and for outputs that cannot be
written, and the checks every entry point shares: `Number` is the range
of a numeric argument, checked the same way from the command line (as an
argparse type) and from Python (`Number.check`); the path checks say
whether an output can be written, before any work."""

import argparse
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Iterable


class UsageError(ValueError):
    """Bad input to zpp-jax: a value, shape, file or flag that cannot work.

    The message names the problem and the fix. A `ValueError`, so code that
    catches ValueError keeps working; `zpp` prints it as one line and exits
    with status 2, while any other exception is an internal error and keeps
    its traceback.
    """


class OutputError(UsageError):
    """An output of a run (a checkpoint, the metrics, a plot) could not be
    written: a full disk, a read-only directory, a path in use by another
    run. The message names the path and the cause; `zpp` prints it as one
    line and exits with status 2, like any `UsageError`. What was already
    written stays intact."""


def check_positive_finite(name: str, value, what: str) -> None:
    """Raise UsageError unless `value` is a real number, > 0 and finite;
    the message names it as `name`, "a positive finite `what`"."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (real and 0 < value < float("inf")):
        raise UsageError(f"{name} must be a positive finite {what}, got {value!r}")


def check_optimizer(optimizer) -> None:
    """Raise UsageError unless `optimizer` is an optax
    GradientTransformation (something with `init` and `update`), naming
    the common slip of passing optax's factory itself."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    got = type(optimizer).__name__
    if callable(optimizer):
        name = getattr(optimizer, "__name__", got)
        got = f"{got} {name}: call it to make one, such as {name}(3e-4)"
    raise UsageError(
        f"optimizer must be an optax.GradientTransformation (such as optax.adamw(3e-4)), got {got}"
    )


def check_compute_dtype(value):
    """The floating-point dtype `value` names (None: None, the model's own
    dtypes); UsageError for a name that is not a dtype or one that is not
    floating point."""
    if value is None:
        return None
    import jax.numpy as jnp

    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise UsageError(
            f"compute_dtype {value!r} is not a dtype: use 'bfloat16', 'float16' or 'float32'"
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UsageError(
            f"compute_dtype must be a floating dtype (bfloat16, float16, float32), got {dtype.name}"
        )
    return dtype


def check_policy(policy, api: str) -> None:
    """Raise UsageError unless `policy` (which submodules are units) is None,
    a function, or a sequence of module types or paths that is not a
    string."""
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return
    if isinstance(policy, str | bytes | type) or not isinstance(policy, Iterable):
        raise UsageError(
            f"{api} policy={policy!r}: pass a function (path, module) -> bool, a list of module "
            "types such as [nnx.Linear], or a list of paths such as [('blocks', 0)]"
        )


def check_positive_ints(obj, names, prefix: str = "") -> None:
    """Raise UsageError unless each attribute `names` of `obj` is an int > 0."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UsageError(f"{prefix}{name} must be a positive int, got {v!r}")


INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Number:
    """A numeric flag: `kind` (int or float) in [`low`, `high`] (None: no
    bound); `above` makes `low` exclusive (a float that must be > 0).
    Floats must be finite. `why` says where a bound comes from."""

    kind: type = int
    low: float | None = None
    high: float | None = None
    above: bool = False
    why: str = ""

    def __call__(self, text: str) -> int | float:
        """The flag's value from the command line; an
        `argparse.ArgumentTypeError` saying what is wrong otherwise."""
        try:
            value = self.kind(text)
        except ValueError:
            what = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value

    def check(self, name: str, value) -> None:
        """Raise UsageError unless `value` (given from Python) is in range."""
        kinds = (int, float) if self.kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "an int" if self.kind is int else "a number"
            raise UsageError(f"{name} must be {kind}, got {value!r}")
        problem = self.problem(value)
        if problem:
            raise UsageError(f"{name} {problem}, got {value!r}")

    def problem(self, value) -> str | None:
        """What is wrong with `value`, or None."""
        if self.kind is float and not math.isfinite(value):
            return "must be a finite number"
        too_low = self.low is not None and (value <= self.low if self.above else value < self.low)
        too_high = self.high is not None and value > self.high
        if not (too_low or too_high):
            return None
        return f"must be {self.describe()}" + (f" ({self.why})" if self.why else "")

    def describe(self) -> str:
        kind = "an int" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            return f"{kind} from {self.low:,} to {self.high:,}"
        if self.low is not None:
            return f"{kind} {'>' if self.above else '>='} {self.low:,}"
        return f"{kind} <= {self.high:,}"


def count(low: int = 1, high: int = INT32_MAX, why: str = "") -> Number:
    """An int flag in [low, high] (default: positive, within int32)."""
    return Number(int, low, high, why=why)


def positive(why: str = "") -> Number:
    """A finite float flag > 0."""
    return Number(float, 0, None, above=True, why=why)


def check_writable_file(flag: str, path: pathlib.Path) -> None:
    """Raise UsageError unless a file can be written at `path` (given as
    `flag`): not a directory, writable if it exists, else its folder can
    be made."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
        return
    check_creatable(f"{flag} {path}", path.parent)


def is_stream(path: str) -> bool:
    """Whether a `--metrics` path is a stream: ``-`` (standard output), a
    path under /dev or /proc (``/dev/stdout``, ``/dev/full``), or an
    existing path that is neither a regular file nor a directory (a FIFO,
    a socket, a device). A stream is written in order and never read back,
    cut, renamed over or replaced."""
    if path == "-":
        return True
    given = pathlib.Path(path).absolute()
    if given.is_dir():
        return False
    for p in (given, pathlib.Path(os.path.realpath(given))):
        if p.parts[1:2] in (("dev",), ("proc",)):
            return True
    return given.exists() and not given.is_file()


def check_stream(flag: str, path: str) -> None:
    """Raise UsageError unless the stream `path` (given as `flag`) can be written."""
    if path != "-" and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: not writable (or does not exist)")


def check_creatable(what: str, directory: pathlib.Path) -> None:
    """`directory` exists and is writable, or can be created."""
    p = directory.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise UsageError(f"{what}: {p} is a file, not a directory")
    if not os.access(p, os.W_OK):
        raise UsageError(f"{what}: {p} is not writable")


def read_json_object(file: pathlib.Path) -> dict:
    """The JSON object in `file`; a UsageError naming the file when it is
    not UTF-8 JSON or holds something other than an object."""
    try:
        data = json.loads(pathlib.Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{file} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{file} holds {type(data).__name__}, not a JSON object")
    return data
