"""The exception types for bad input and for outputs that cannot be
written, and the checks every entry point shares."""


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


def check_positive_ints(obj, names, prefix: str = "") -> None:
    """Raise UsageError unless each attribute `names` of `obj` is an int > 0."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UsageError(f"{prefix}{name} must be a positive int, got {v!r}")


def check_int_range(name: str, value, low: int, high: int, why: str = "") -> None:
    """Raise UsageError unless `value` is an int in [`low`, `high`]; `why`
    (optional) says where the bound comes from."""
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        reason = f" ({why})" if why else ""
        raise UsageError(f"{name} must be an int from {low:,} to {high:,}{reason}, got {value!r}")
