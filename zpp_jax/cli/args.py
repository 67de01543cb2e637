"""The one rule for the `zpp` command's input: every error is one line on
stderr, ``zpp <command>: error: ...``, with exit status 2, before any work.

* `zpp_jax.errors.Number` is the type of every numeric flag: it parses
  the text and checks the flag's range, so that a value out of range is
  refused by the parser, naming the flag, the range and why.
* The flags of `zpp train` are generated from the fields of
  `zpp_jax.recipes.RunConfig` and `zpp_jax.ZeroPPConfig` (`zpp_jax.fields`),
  which check the same values given from Python: each is written once.
* `Parser` is `argparse.ArgumentParser` with one-line errors.

Importing this module costs no JAX.
"""

from __future__ import annotations

import argparse
import os

from zpp_jax.distributed import ENV_PROCESS_ID


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line on stderr,
    ``<prog>: error: ...``, and exit status 2 (argparse adds the usage). In
    a job every process parses the same command line and fails alike:
    process 0 says why."""

    def error(self, message: str) -> None:
        lead = os.environ.get(ENV_PROCESS_ID, "0") in ("", "0")
        self.exit(2, f"{self.prog}: error: {message}\n" if lead else None)
