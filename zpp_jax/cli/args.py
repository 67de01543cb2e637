"""The one rule for the `zpp` command's input: every error is one line on
stderr, ``zpp <command>: error: ...``, with exit status 2, before any work.

* `zpp_jax.errors.Number` is the type of every numeric flag: it parses
  the text and checks the flag's range, so that a value out of range is
  refused by the parser, naming the flag, the range and why.
* `RUN` holds the ranges of `zpp train`'s counts, shared with
  `zpp_jax.cli.train.RunConfig` (which checks the same values given from
  Python): each range is written once.
* `Parser` is `argparse.ArgumentParser` with one-line errors.

Importing this module costs no JAX.
"""

from __future__ import annotations

import argparse
import os
from types import MappingProxyType

from zpp_jax.distributed import ENV_PROCESS_ID
from zpp_jax.errors import count, positive

# `zpp train`'s counts, shared with RunConfig (`zpp_jax.cli.train`); read-only.
RUN = MappingProxyType(
    {
        "nodes": count(),
        "local": count(),
        "stages": count(),
        "batch": count(why="sequences per step"),
        "grad_accum": count(why="micro-batches, at most --batch"),
        "steps": count(why="the optimizer counts steps in int32"),
        "warmup": count(0, why="steps"),
        "eval_every": count(0, why="steps; 0: never"),
        "eval_batches": count(),
        "ckpt_every": count(0, why="steps; 0: only the last"),
        "seed": count(0, 2**32 - 1, "32 bits"),
        "seq_len": count(why="tokens; leave it out for the preset's length"),
        "lr": positive("a learning rate"),
        "clip": positive("a gradient norm"),
    }
)


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line on stderr,
    ``<prog>: error: ...``, and exit status 2 (argparse adds the usage). In
    a job every process parses the same command line and fails alike:
    process 0 says why."""

    def error(self, message: str) -> None:
        lead = os.environ.get(ENV_PROCESS_ID, "0") in ("", "0")
        self.exit(2, f"{self.prog}: error: {message}\n" if lead else None)
