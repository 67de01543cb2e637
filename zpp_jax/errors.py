"""The one exception type for bad input."""


class UsageError(ValueError):
    """Bad input to zpp-jax: a value, shape, file or flag that cannot work.

    The message names the problem and the fix. A `ValueError`, so code that
    catches ValueError keeps working; `zpp` prints it as one line and exits
    with status 2, while any other exception is an internal error and keeps
    its traceback.
    """
