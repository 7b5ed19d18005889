"""The run's one-line state in its status.json (run_dir.RunDir.status): running, preempted, finished or failed.

Launchers read it to decide what comes next (`clustertrain slurm job-end` requeues only a run that was
stopped on purpose), because an exit code does not survive every launcher (torchrun reports 1).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clustertrain.files import read_json_object, write_atomic
from clustertrain.run_dir import RunDir

if TYPE_CHECKING:  # the Slurm job's own steps read status.json: no torch import for them
    from clustertrain.distributed.failures import RankFailure

STATUS_FILE = RunDir(Path()).status.name  # the file's name alone, as a run directory's listing shows it


def write_status(run: RunDir, state: str, **fields: Any) -> None:
    """Replace the run's status, stamped with the time, host and Slurm job (if any): atomically, or in place
    when the disk has no room for a new file.

    Raises:
        OSError: Neither way could write it (the caller decides whether that ends the run).
    """
    record = {
        "state": state,
        "time": time.time(),
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        **fields,
    }
    text = json.dumps(record, default=str) + "\n"
    run.root.mkdir(parents=True, exist_ok=True)
    path = run.status
    try:
        write_atomic(path, text)
    except OSError:
        if not path.is_file():
            raise
        # A full disk (or quota) has no block for a new file, but status.json already holds one, and a record of a
        # few hundred bytes rewritten over it in place needs no other: so "failed" still reaches the launchers
        # that read it (they would wait on "running"). Not atomic, so only when the atomic way failed; no
        # O_TRUNC, which would free the block before the write needs it.
        data = text.encode()
        fd = os.open(path, os.O_WRONLY)
        try:
            written = os.write(fd, data)
            os.ftruncate(fd, written)
        finally:
            os.close(fd)
        if written < len(data):
            raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written", str(path))


def read_status(run: RunDir) -> dict[str, Any] | None:
    """The last status written, or None if there is none (or it is unreadable, or not a status)."""
    try:
        return load_status(run)
    except (OSError, ValueError):
        return None


def load_status(run: RunDir) -> dict[str, Any] | None:
    """The last status written, or None if there is none; read by files.read_regular (a FIFO or a link to a
    device there never blocks a launcher or `clustertrain status`).

    Raises:
        OSError: status.json cannot be read; its `strerror` says why (not a regular file, too large, ...).
        ValueError: It is not a status: not JSON, not an object, or no "state" string.
    """
    try:
        status = read_json_object(run.status)
    except FileNotFoundError:
        return None
    if not isinstance(status.get("state"), str):
        raise ValueError('not a status (no "state" string)')
    return status


def record_failure(run: RunDir, error: BaseException, first: RankFailure | None, step: int,
                   checkpoint: Path | None, started: bool = True) -> None:
    """status.json says "failed", with the error that ended the run: `first`, the first failure of any rank
    (None for a second Ctrl-C, which interrupts without saving), else `error`; `before_start` when it came before
    the first step (a process group, device or node that did not come up: the Slurm path retries such a start).
    Best effort: the error that matters is the run's own."""
    message = f"{type(error).__name__}: {error}" if first is None or first.rank == 0 else str(first)
    if first is None:
        message = f"interrupted by a second Ctrl-C, without saving (last checkpoint: {checkpoint or 'none'})"
    with contextlib.suppress(OSError):
        write_status(run, "failed", step=step, error=message, **({} if started else {"before_start": True}))


def record_hang(run: RunDir, report: dict[str, Any], step: int, total_steps: int | None,
                checkpoint: Path | None) -> None:
    """status.json says "hung", with the watchdog's report (its line, the stuck ranks and hosts, the phase)."""
    write_status(run, "hung", step=step, total_steps=total_steps, checkpoint=str(checkpoint) if checkpoint else None,
                 error=report["line"], **{k: report[k] for k in ("stuck_ranks", "stuck_hosts", "phase")})
