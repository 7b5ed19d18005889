"""A run's checkpoints, from start to end: which one a start resumes, loading it, saving (sync or async),
retention, disk errors.

    point = choose_resume(run, config.train.resume, config.train.overwrite)  # before the model: fail fast
    checkpoints = CheckpointManager(run, config.checkpoint, final_step, device, extras,
                                    Tracked(runner.parts, optimizer, loader, scaler), point)  # once they are built
    state = checkpoints.resume(config.train)     # restores them; the TrainState, or None for a fresh start
    checkpoints.save(step, tokens_seen)          # final=True: the run's last, which must succeed

A run's last save must succeed: if it fails, the run fails with ExitCode.SAVE_FAILED. (Stopping on a
signal or the walltime, and the exit code that asks for a requeue, are clustertrain.distributed.stop's.)
"""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.checkpoint.base import base_reference
from clustertrain.checkpoint.load import load_checkpoint
from clustertrain.checkpoint.train_state import TrainState
from clustertrain.config.budget import check_budget_reaches
from clustertrain.config.schema import CheckpointConfig, TrainConfig
from clustertrain.distributed.collectives import reduce_values
from clustertrain.errors import CheckpointError, ExitCode, one_line
from clustertrain.run_dir import RunDir

WRITE_ERRORS = (Exception, CheckpointException)  # DCP's exception derives from BaseException


class SaveFailed(CheckpointError):
    """A checkpoint write failed where the run cannot go on: its last save, or any with checkpoint.on_error: stop.

    Not the config's fault, so not exit 2: the disk is full or the quota hit; the message names the lost
    steps and the checkpoint that is intact, to resume from once there is room.
    """

    exit_code = ExitCode.SAVE_FAILED


@dataclass
class StandAlone:
    """What makes a checkpoint folder usable alone: the run's resolved config, and the model's HF config and
    tokenizer when they come from a snapshot the checkpoint must not depend on.

    Attributes:
        snapshot: the local model the run started from; with `adapters_only`, a checkpoint holds only what
            trains and refers to this snapshot for the frozen rest (clustertrain.checkpoint.base).
        strategy: the run's parallel.strategy, recorded in the train state.
    """

    config_yaml: str
    hf_config: Any = None  # transformers.PretrainedConfig
    tokenizer: Any = None
    snapshot: Path | None = None
    adapters_only: bool = False
    strategy: str | None = None

    def write(self, folder: Path) -> None:
        """Rank 0 writes these into a checkpoint folder before its train state."""
        (folder / "config.yaml").write_text(self.config_yaml)
        if self.snapshot is not None and self.hf_config is not None:
            self.hf_config.save_pretrained(folder / "model")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder / "tokenizer")


@dataclass
class Tracked:
    """The run's objects a checkpoint saves and a resume restores in place."""

    parts: nn.Module | list[nn.Module]  # the model, or this rank's pipeline stages
    optimizer: Optimizer | None
    loader: Any = None  # the data position: state_dict() (a collective: every rank saves) and load_state_dict()
    scaler: Any = None  # float16's loss scaler


@dataclass(frozen=True)
class ResumePoint:
    """Where a start resumes: a checkpoint folder, or None for a fresh start (`choose_resume`).

    Attributes:
        start_over: train.overwrite over a run directory with checkpoints: its earlier run is moved aside.
    """

    checkpoint: Path | None
    start_over: bool = False


def choose_resume(run: RunDir, resume: str, overwrite: bool) -> ResumePoint:
    """The checkpoint this start resumes from (every rank calls, before the model is built: a refusal costs
    nothing): `train.resume`'s path, or under auto the newest complete one; none for a fresh start. Rank 0 first
    removes the leftovers of interrupted saves (publishing one that was stopped after its last write). The run
    directory is locked: no other run adds a checkpoint.

    Raises:
        CheckpointError: train.resume names no folder, or is 'none' where checkpoints exist without
            train.overwrite.
    """
    if dist.get_rank() == 0:
        ckpt.remove_incomplete(run.checkpoints)
    dist.barrier()
    latest = ckpt.latest_checkpoint(run.checkpoints)
    if resume == "none" and latest is not None and not overwrite:
        raise CheckpointError(
            f"{run.root} already holds checkpoints and train.resume is 'none'; use --resume auto to "
            "continue it, --overwrite to start over (the old run is moved aside), or another train.run_dir"
        )
    chosen = None if resume == "none" else latest if resume == "auto" else Path(resume)
    if chosen is not None and not chosen.is_dir():
        raise CheckpointError(f"train.resume: checkpoint {chosen} does not exist")
    return ResumePoint(chosen, start_over=resume == "none" and latest is not None)


class CheckpointManager:
    """Owns a run's checkpoint folder: the checkpoint a start resumes (choose, resume), and saves (sync or async,
    at most one in flight), pruned to the retention, surviving failed writes.

    An async save is committed by the first `commit_if_done()` after its write has finished, or by the next
    save or `finalize()`, which wait for it.
    """

    def __init__(self, run: RunDir, config: CheckpointConfig, final_step: int, device: torch.device,
                 extras: StandAlone, tracked: Tracked | None = None, resume_point: ResumePoint | None = None,
                 log: Callable[[str], None] = print):
        self.run, self.root = run, run.checkpoints
        self.config, self.final_step, self.extras, self.log = config, final_step, extras, log
        # auto: async on GPUs, where the step waits only for a copy into pinned host memory; on the CPU the
        # copy is most of a save's cost, and the background write would compete with training for the cores
        self.async_save = device.type == "cuda" if config.async_save == "auto" else config.async_save
        self.pinned_staging = self.async_save and device.type == "cuda"
        self._staging: dict[str, Any] | None = None  # made at the first save, then kept: it holds the buffers
        self.rank0 = dist.get_rank() == 0
        self._pending: tuple[Future | None, int, TrainState] | None = None
        self.tracked = tracked
        self.resume_point = resume_point or ResumePoint(None)
        self.last: Path | None = None  # the newest committed checkpoint of this run (the resumed one at first)
        self.saved_step: int | None = None  # the step of the last save started (or resumed from)
        self.failed_step: int | None = None  # the step of the last save that failed
        self.blocking_s: list[float] = []
        self._async_group = None

    # ---- resume ------------------------------------------------------------------------------
    def resume(self, train: TrainConfig) -> TrainState | None:
        """Load the resume point's checkpoint into the tracked objects (every rank calls) and return its train
        state; None for a fresh start, which moves an earlier run aside under train.overwrite (nothing is deleted).

        Raises:
            ConfigError: the run's budget (train.steps, train.tokens) ends at or before the checkpoint's step.
        """
        if self.resume_point.start_over:
            dist.barrier()  # every rank has seen the old checkpoints before rank 0 moves them
            if self.rank0:
                moved = self.run.move_aside()
                print(f"moved the previous run's files to {moved}", flush=True)
            dist.barrier()
        chosen, tracked = self.resume_point.checkpoint, self.tracked
        if chosen is None:
            return None
        state = load_checkpoint(chosen, tracked.parts, tracked.optimizer, snapshot=self.extras.snapshot)
        check_budget_reaches(train, self.final_step, state.step, chosen)
        if tracked.loader is not None and state.data is not None:  # an imported model starts the data afresh
            tracked.loader.load_state_dict(state.data)
        if tracked.scaler is not None and state.grad_scaler is not None:
            tracked.scaler.load_state_dict(state.grad_scaler)
        self.last, self.saved_step = chosen, state.step
        return state

    # ---- save --------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return bool(self.config.every) and step % self.config.every == 0

    def saved(self, step: int) -> bool:
        """Whether `step` is saved already, or being written (and that save has not failed)."""
        return self.saved_step == step and self.failed_step != step

    def save(self, step: int, tokens_seen: int, *, wait: bool = False, final: bool = False) -> Path | None:
        """Save the tracked objects at `step`; returns the committed folder (None while an async save is still
        writing, or if it failed). Every rank calls.

        With `extras.adapters_only` only the trainable weights and their optimizer state are saved, with a
        reference to the base snapshot. `final`: the run ends with this save (its budget,
        `train.stop_after_steps`, a stop signal), so it is waited for, and a failure raises SaveFailed whatever
        `checkpoint.on_error` says.
        """
        start = time.perf_counter()  # blocking time includes waiting for the previous save
        self.saved_step = step
        self.finalize()  # the previous save's write reads the staging buffers this save reuses
        if self.async_save and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        if self.pinned_staging and self._staging is None:
            self._staging = ckpt.pinned_staging()
        tracked, extras = self.tracked, self.extras
        state = TrainState(
            step=step, tokens_seen=tokens_seen, total_steps=self.final_step, world_size=dist.get_world_size(),
            data=tracked.loader.state_dict() if tracked.loader is not None else None,  # gathered from every rank
            strategy=extras.strategy, grad_scaler=tracked.scaler.state_dict() if tracked.scaler else None,
            base=base_reference(extras.snapshot) if extras.adapters_only else None,  # it holds only what trains
        )
        try:
            future = ckpt.write_shards(self.root, step, tracked.parts, tracked.optimizer, async_group=self._async_group,
                                       staging=self._staging, trainable_only=extras.adapters_only)
        except WRITE_ERRORS as e:  # any write failure: report, keep the previous checkpoint
            self._failed(step, e, final)
            return None
        self._pending = (future, step, state)
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
        future, step, state = self._pending
        self._pending = None
        try:
            if future is not None:
                future.result()
            path = ckpt.commit(self.root, step, state, self.extras.write)
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
        reason = f"{type(error).__name__}: {one_line(error)[:200]}"
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
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or (code is None and isinstance(error, OSError)):
        return "free space"
    if not isinstance(error, OSError):  # not the file system's: a bug in saving, which space will not fix
        return "report this error (it is not the disk's)"
    return "fix what the error names"
