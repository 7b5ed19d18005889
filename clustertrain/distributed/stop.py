"""Stopping on purpose: the stop signals, their agreement across ranks, and the exit code that says "requeue me".

Slurm warns a job before killing it (SIGUSR1 from `--signal`, SIGTERM on preemption, cancellation and
time limit); a user presses Ctrl-C (SIGINT). The CLI listens from the first instant of the process
(`listen_early`), the trainer takes over (`StopRequests`); a warning may reach only some ranks, so ranks
agree on a step boundary (one tiny all-reduce on a CPU group, at log steps and about every AGREE_EVERY_S
seconds between them), all save the same step, and the run ends with `Preempted`: exit ExitCode.REQUEUE,
status `preempted`.

Only the standard library is imported here at first: the CLI listens before torch loads (a second or more).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clustertrain.errors import ExitCode

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # save and stop; a second SIGINT: stop now
# Between log steps, ranks agree on stopping about this often: far inside Slurm's warning (slurm.signal_before) and
# train.walltime_margin, and rare enough that the agreement, which waits for the slowest of all ranks (tens of ms
# at a thousand), costs nothing measurable.
AGREE_EVERY_S = 5.0


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

    exit_code = ExitCode.REQUEUE

    def __init__(self, reason: str, step: int, checkpoint: Path | None):
        saved = f" after saving {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {reason} at step {step}{saved}; exit {ExitCode.REQUEUE} = requeue me")
        self.checkpoint = checkpoint


class StopRequests:
    """Collects SIGTERM/SIGUSR1/SIGINT and the walltime deadline; every rank calls `agreed()` at every step boundary.

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
        self._boundaries = 0  # calls of agreed() so far
        self._next_agreement = 1  # the call that agrees, whether or not it is told to
        self._last_agreement: tuple[int, float] | None = None  # (call, time.monotonic())
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

    def agreed(self, now: bool = True) -> str | None:
        """The stop reason if any rank has one (every rank gets the same answer), else None.

        Every rank calls it at every step boundary, with the same `now`. With several ranks the answer is agreed in
        one tiny all-reduce on a CPU group, which waits for the slowest rank: when `now` (the trainer's log steps,
        which wait for the GPU anyway), and between those at boundaries the ranks agreed on at the last agreement,
        about AGREE_EVERY_S seconds apart by the slowest rank's steps. Other boundaries answer None at no cost: a
        stop comes at most about AGREE_EVERY_S seconds and a step after the first rank saw it.
        """
        self._boundaries += 1
        if self.reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.reason = "walltime"
        import torch.distributed as dist

        from clustertrain.distributed.collectives import reduce_values

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.reason
        if not now and self._boundaries < self._next_agreement:
            return None
        if self._group is None:  # gloo keeps this off the GPU stream: no device sync
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        step_s = 0.0  # this rank's seconds per step since the last agreement (none yet: agree again at the next)
        if self._last_agreement is not None:
            call, at = self._last_agreement
            step_s = (time.monotonic() - at) / (self._boundaries - call)
        code, slowest_s = reduce_values([0 if self.reason is None else 1 + self.REASONS.index(self.reason), step_s],
                                        group=self._group, op="max")
        self._next_agreement = self._boundaries + (max(1, int(AGREE_EVERY_S / slowest_s)) if slowest_s else 1)
        self._last_agreement = (self._boundaries, time.monotonic())
        code = int(code)
        return None if code == 0 else self.REASONS[code - 1]

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
