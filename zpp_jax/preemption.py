"""Preemption: SIGTERM and SIGINT as a request to stop between two steps.

A cluster that takes a machine back sends SIGTERM and allows some seconds
before SIGKILL; a user stops a run with Ctrl-C (SIGINT). Either way a
training loop should finish the step it is in, save, and exit, so that
``--resume`` loses no completed step. `StopRequest` records the signal
instead of letting it end the process (or raise `KeyboardInterrupt` in the
middle of a step or a save), and `StopRequest.agreed` tells the loop, at a
step boundary, whether to stop: in a multi-process job every process
answers the same at the same step, so that their checkpoint is one
consistent save.

    with StopRequest() as stop:
        for step in range(steps):
            if stop.agreed():
                save(step)
                raise Stopped(stop.agreed(), step, "checkpoint saved")
            state = train_step(state, batch)

A second signal while stopping is reported and otherwise ignored: the save
in progress completes, and the checkpoint before it stays the latest until
it does (orbax renames a checkpoint into place only once complete). SIGKILL
still ends the process at once, with the same guarantee.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from zpp_jax.distributed import max_over_processes

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):  # noqa: N818 - a run that stopped, not an error
    """A run stopped by a signal at a step boundary, after its state was
    saved (or with nothing to save). `exit_status` is 128 + the signal's
    number, as a shell reports a process ended by that signal."""

    def __init__(self, signum: int, step: int, what: str) -> None:
        self.signum, self.step = signum, step
        self.exit_status = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}: {what}")


class StopRequest:
    """Records the first SIGTERM or SIGINT received inside its `with` block
    (handlers are installed on entry and the previous ones restored on
    exit; outside the main thread, where Python cannot install handlers, it
    records nothing)."""

    def __init__(self) -> None:
        self.received = 0  # the first signal's number, 0 for none
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            # None: a handler installed outside Python (JAX's preemption
            # notifier), which cannot be put back; the default ends the process.
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.received:
            self.received = signum
            message = f"{name}: stopping after the current step"
        else:
            message = (
                f"{name} again: still stopping, a save in progress completes (SIGKILL ends "
                "the process now, keeping the last complete checkpoint)"
            )
        os.write(2, f"\nzpp: {message}\n".encode())

    def agreed(self) -> int:
        """The signal number to stop for, or 0 to go on: the largest signal
        any process of the job received (all processes call it at the same
        step, and all get the same answer). Costs one 4-byte all-gather in
        a multi-process job, nothing in one process."""
        return max_over_processes(self.received)
