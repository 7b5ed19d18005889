"""When to save, what to keep, and when to stop: retention, async saves, disk errors, preemption.

Slurm warns a job before killing it (SIGUSR1 from `--signal`, SIGTERM on preemption, cancellation and
time limit); a user presses Ctrl-C (SIGINT). A warning may reach only some ranks, so ranks agree at every
step boundary (one tiny all-reduce on a CPU group) and all save the same step; the process then exits
with REQUEUE_EXIT_CODE. A run's last save must succeed: if it fails, the run fails with SAVE_FAILED_EXIT_CODE.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.config.schema import CheckpointConfig
from clustertrain.distributed.collectives import reduce_values
from clustertrain.distributed.spawn import STOP_SIGNALS, EarlySignals
from clustertrain.errors import CheckpointError
from clustertrain.train.status import REQUEUE_EXIT_CODE

WRITE_ERRORS = (Exception, CheckpointException)  # DCP's exception derives from BaseException
SAVE_FAILED_EXIT_CODE = 74  # EX_IOERR: a checkpoint could not be written (disk full, quota, permissions)


class SaveFailed(CheckpointError):
    """A checkpoint write failed where the run cannot go on: its last save, or any with checkpoint.on_error: stop.

    Not the config's fault, so not exit 2: the disk is full or the quota hit; the message names the lost
    steps and the checkpoint that is intact, to resume from once there is room.
    """

    exit_code = SAVE_FAILED_EXIT_CODE


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


class CheckpointManager:
    """Saves (sync or async, at most one in flight), prunes old checkpoints, survives failed writes."""

    def __init__(self, root: Path, config: CheckpointConfig, final_step: int, log: Callable[[str], None],
                 device: torch.device):
        self.root, self.config, self.final_step, self.log = root, config, final_step, log
        # auto: async on GPUs, where the step waits only for a copy into pinned host memory; on the CPU the
        # copy is most of a save's cost, and the background write would compete with training for the cores
        self.async_save = device.type == "cuda" if config.async_save == "auto" else config.async_save
        self._writer = dcp.FileSystemWriter(root, cache_staged_state_dict=True) if (
            self.async_save and device.type == "cuda") else None
        self.rank0 = dist.get_rank() == 0
        self._pending: tuple[Future | None, int, dict[str, Any], Callable[[Path], None]] | None = None
        self.last: Path | None = None
        self.failed_step: int | None = None  # the step of the last save that failed
        self.blocking_s: list[float] = []
        self._async_group = None

    def due(self, step: int) -> bool:
        return bool(self.config.every) and step % self.config.every == 0

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, train_state: dict[str, Any],
             write_extras: Callable[[Path], None], *, wait: bool = False, final: bool = False) -> Path | None:
        """Save `step`; returns the committed folder (None while an async save is still writing, or if it failed).

        A `train_state` with a `base` (LoRA on a snapshot) saves only the trainable weights and their optimizer
        state. `final`: the run ends with this save (its budget, `train.stop_after_steps`, a stop signal), so it
        is waited for, and a failure raises SaveFailed whatever `checkpoint.on_error` says.
        """
        start = time.perf_counter()  # blocking time includes waiting for the previous save
        self.finalize()
        if self.async_save and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        try:
            future = ckpt.write_shards(self.root, step, model, optimizer, async_group=self._async_group,
                                       writer=self._writer, trainable_only="base" in train_state)
        except WRITE_ERRORS as e:  # any write failure: report, keep the previous checkpoint
            self._failed(step, e, final)
            return None
        self._pending = (future, step, train_state, write_extras)
        path = self.finalize(final=final) if wait or final or not self.async_save else None
        self.blocking_s.append(time.perf_counter() - start)
        return path

    def finalize(self, final: bool = False) -> Path | None:
        """Wait for the save in flight, then make it visible and prune; every rank must call this.

        `final`: as for save(), the run ends with the save in flight.
        """
        if self._pending is None:
            return None
        future, step, train_state, write_extras = self._pending
        self._pending = None
        try:
            if future is not None:
                future.result()
            path = ckpt.commit(self.root, step, train_state, write_extras)
        except WRITE_ERRORS as e:
            self._failed(step, e, final)
            return None
        self.last = path
        if self.rank0:
            ckpt.prune(self.root, self.config.keep_last, self.config.keep_every, self.final_step)
        return path

    def _failed(self, step: int, error: BaseException, final: bool) -> None:
        if isinstance(error, CheckpointException) and error.failures:  # the first rank's own error, not DCP's report
            error = next(iter(error.failures.values()))[0]
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        free_gb = shutil.disk_usage(self.root).free / 1e9 if self.root.exists() else float("nan")
        kept = ckpt.latest_checkpoint(self.root)
        message = (f"checkpoint of step {step} failed ({reason}; {free_gb:.1f} GB free under {self.root}); "
                   + (f"{kept} is intact" if kept else "no earlier checkpoint exists"))
        if self.rank0:
            ckpt.remove_incomplete(self.root)
        self.failed_step = step
        if final:  # nothing saves these steps later: the run must not report success (Slurm: COMPLETED)
            first_lost = int(kept.name.split("-")[1]) + 1 if kept else 1
            again = f"it resumes from {kept.name}" if kept else "it starts over"
            raise SaveFailed(f"{message}; it was this run's last save, so steps {first_lost}-{step} are lost: free "
                             f"space, then run again ({again})") from None
        if self.config.on_error == "stop":
            raise SaveFailed(message + "; stopping (checkpoint.on_error: stop)") from None
        self.log(f"warning: {message}; training goes on (checkpoint.on_error: warn)")
