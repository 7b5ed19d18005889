"""When to save and what to keep: retention, async saves, disk errors.

A run's last save must succeed: if it fails, the run fails with SAVE_FAILED_EXIT_CODE. (Stopping on a
signal or the walltime, and the exit code that asks for a requeue, are clustertrain.distributed.stop's.)
"""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.config.schema import CheckpointConfig
from clustertrain.distributed.collectives import reduce_values
from clustertrain.errors import CheckpointError

WRITE_ERRORS = (Exception, CheckpointException)  # DCP's exception derives from BaseException
SAVE_FAILED_EXIT_CODE = 74  # EX_IOERR: a checkpoint could not be written (disk full, quota, permissions)


class SaveFailed(CheckpointError):
    """A checkpoint write failed where the run cannot go on: its last save, or any with checkpoint.on_error: stop.

    Not the config's fault, so not exit 2: the disk is full or the quota hit; the message names the lost
    steps and the checkpoint that is intact, to resume from once there is room.
    """

    exit_code = SAVE_FAILED_EXIT_CODE


class CheckpointManager:
    """Saves (sync or async, at most one in flight), prunes old checkpoints, survives failed writes.

    An async save is committed by the first `commit_if_done()` after its write has finished, or by the next
    save or `finalize()`, which wait for it.
    """

    def __init__(self, root: Path, config: CheckpointConfig, final_step: int, log: Callable[[str], None],
                 device: torch.device):
        self.root, self.config, self.final_step, self.log = root, config, final_step, log
        # auto: async on GPUs, where the step waits only for a copy into pinned host memory; on the CPU the
        # copy is most of a save's cost, and the background write would compete with training for the cores
        self.async_save = device.type == "cuda" if config.async_save == "auto" else config.async_save
        self.pinned_staging = self.async_save and device.type == "cuda"
        self._staging: dict[str, Any] | None = None  # made at the first save, then kept: it holds the buffers
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
        self.finalize()  # the previous save's write reads the staging buffers this save reuses
        if self.async_save and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        if self.pinned_staging and self._staging is None:
            self._staging = ckpt.pinned_staging()
        try:
            future = ckpt.write_shards(self.root, step, model, optimizer, async_group=self._async_group,
                                       staging=self._staging, trainable_only="base" in train_state)
        except WRITE_ERRORS as e:  # any write failure: report, keep the previous checkpoint
            self._failed(step, e, final)
            return None
        self._pending = (future, step, train_state, write_extras)
        path = self.finalize(final=final) if wait or final or not self.async_save else None
        self.blocking_s.append(time.perf_counter() - start)
        return path

    def commit_if_done(self) -> Path | None:
        """Commit the save in flight if its background write has finished on every rank, without waiting for it;
        returns the committed folder, else None. Every rank calls this at the same step (a log step).

        Ranks must agree, since commit() has barriers, and a rank's Future may finish a moment before another's.
        DCP's async_save ends with a collective ("write": every rank's result gathered on rank 0, which writes
        the metadata, then broadcast), so once every rank's Future is done, every shard and the metadata are on
        disk, and a failed write failed on every rank. One tiny reduction of the ranks' `done()` flags decides:
        on the world group, in the main thread (a log step syncs with the GPU anyway), never on the async
        group, whose collectives the background write may be in the middle of.
        """
        if self._pending is None:
            return None
        future = self._pending[0]
        done = future is None or future.done()
        if dist.get_world_size() > 1:
            done = reduce_values([float(done)], op="min")[0] == 1.0
        return self.finalize() if done else None

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
        kept = ckpt.latest_checkpoint(self.root) if self.root.is_dir() else None
        message = (f"checkpoint of step {step} failed ({reason}; {free_gb:.1f} GB free under {self.root}); "
                   + (f"{kept} is intact" if kept else "no earlier checkpoint exists"))
        if self.rank0:
            ckpt.remove_incomplete(self.root)
        self.failed_step = step
        if final:  # nothing saves these steps later: the run must not report success (Slurm: COMPLETED)
            first_lost = int(kept.name.split("-")[1]) + 1 if kept else 1
            again = f"it resumes from {kept.name}" if kept else "it starts over"
            raise SaveFailed(f"{message}; it was this run's last save, so steps {first_lost}-{step} are lost: "
                             f"{_remedy(error, self.root)}, then run again ({again})") from None
        if self.config.on_error == "stop":
            raise SaveFailed(message + "; stopping (checkpoint.on_error: stop)") from None
        self.log(f"warning: {message}; training goes on (checkpoint.on_error: warn)")


def _remedy(error: BaseException, root: Path) -> str:
    """What to do about a failed write, by its cause: a full disk is not the only one."""
    code = getattr(error, "errno", None)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"make {root} writable"
    if code in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR) or (root.exists() and not root.is_dir()):
        return f"move away what is in the way ({root} must be a folder of checkpoints)"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, None):
        return "free space"
    return "fix what the error names"
