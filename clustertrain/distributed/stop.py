"""Stopping on purpose: the stop signals, their agreement across ranks, and the exit code that says "requeue me".

Slurm warns a job before killing it (SIGUSR1 from `--signal`, SIGTERM on preemption, cancellation and
time limit); a user presses Ctrl-C (SIGINT). The CLI listens from the first instant of the process
(`listen_early`), the trainer takes over (`StopRequests`); a warning may reach only some ranks, so ranks
agree at every step boundary (one tiny all-reduce on a CPU group), all save the same step, and the run
ends with `Preempted`: exit REQUEUE_EXIT_CODE, status `preempted`.

Only the standard library is imported here at first: the CLI listens before torch loads (a second or more).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL, "try again later": the run saved and stopped on purpose; requeue it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # save and stop; a second SIGINT: stop now


class EarlySignals:
    """The stop signals that arrive before the trainer listens (imports, config, model build).

    The trainer's StopRequests takes them over, so a warning during start-up is honoured at step 1. A
    second Ctrl-C exits at once (KeyboardInterrupt), as Python's default would at the first.
    """

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.received:
            raise KeyboardInterrupt
        self.received.append(signum)


@contextlib.contextmanager
def listen_early() -> Iterator[EarlySignals]:
    """Record stop signals from now on, then let through those a launcher held back while this process started."""
    early = EarlySignals()
    previous = {s: signal.signal(s, early) for s in STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        yield early
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Preempted(Exception):
    """Training stopped early on a signal or the walltime, after saving; the launcher should requeue."""

    exit_code = REQUEUE_EXIT_CODE

    def __init__(self, reason: str, step: int, checkpoint: Path | None):
        super().__init__(f"stopped by {reason} at step {step}"
                         + (f" after saving {checkpoint}" if checkpoint else "") + f"; exit {REQUEUE_EXIT_CODE} = requeue me")
        self.checkpoint = checkpoint


class StopRequests:
    """Collects SIGTERM/SIGUSR1/SIGINT and the walltime deadline; `agreed()` is a collective every rank calls.

    Signals that came before it listened (the CLI's EarlySignals, from the first instant of the process) are
    taken over, so a warning during start-up is honoured at step 1. Ctrl-C while a stop is already under
    way (a second Ctrl-C) raises KeyboardInterrupt: exit at once, without the save.
    """

    SIGNALS = STOP_SIGNALS
    REASONS = ("walltime", *(s.name for s in STOP_SIGNALS))

    def __init__(self, walltime_s: float | None, margin_s: float):
        self.reason: str | None = None
        self.deadline = time.monotonic() + walltime_s - margin_s if walltime_s else None
        self._group = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        self._early = next((h for h in self._previous.values() if isinstance(h, EarlySignals)), None)
        if self._early and self._early.received:
            self.reason = signal.Signals(self._early.received[0]).name

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.reason is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: the user does not want to wait for the save
        self.reason = self.reason or signal.Signals(signum).name
        if self._early is not None:  # after close() too, while the process exits, a second Ctrl-C is one
            self._early.received.append(signum)

    def agreed(self) -> str | None:
        """The stop reason if any rank has one (every rank gets the same answer), else None."""
        if self.reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.reason = "walltime"
        import torch.distributed as dist

        from clustertrain.distributed.collectives import reduce_values

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.reason
        if self._group is None:  # gloo keeps this off the GPU stream: no device sync per step
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        code, = reduce_values([0 if self.reason is None else 1 + self.REASONS.index(self.reason)],
                              group=self._group, op="max")
        code = int(code)
        return None if code == 0 else self.REASONS[code - 1]

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
