"""One owner per run directory: `<run_dir>/run.lock`, made atomically and refreshed while its run lives.

Two runs on one run directory destroy each other (one's retention deletes the other's checkpoints, their
metrics interleave), so rank 0 takes the lock before anything in the directory is read, written or moved,
and every rank learns whether it got it. fcntl/flock locks are unreliable on the shared filesystems of
clusters (Lustre, GPFS, NFS); link(2) of a fully written file onto the lock's name is atomic on all of them.
The file names its holder (host, pid, Slurm job, start time); a daemon thread refreshes its mtime every
HEARTBEAT_S seconds. A lock is stale, and taken over with a one-line note, when

- its holder ran on this host and its process is gone (a kill, a crash);
- its heartbeat is older than STALE_AFTER_S (the holder's node died or lost the filesystem);
- it names our own Slurm job at an earlier restart (a requeued job starting again).

    lock = lock_run_dir(run, rank0)       # every rank calls; RunDirLocked (exit 2) names the holder
    ...
    lock.release()                        # rank 0, on every exit path
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from clustertrain.distributed.collectives import all_gather_objects
from clustertrain.errors import UserError
from clustertrain.run_dir import RunDir

log = logging.getLogger(__name__)

LOCK_FILE = RunDir(Path()).lock.name  # the file's name alone, as a run directory's listing shows it
HEARTBEAT_S = 30.0
STALE_AFTER_S = 6 * HEARTBEAT_S  # generous: clocks of hosts and file servers drift, filesystems stall


class RunDirLocked(UserError):
    """Another run holds the run directory (or it cannot be locked at all)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock; `token` tells this very acquisition from any other."""

    host: str
    pid: int
    slurm_job_id: str | None
    slurm_restart: int
    since: float
    token: str

    @classmethod
    def here(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), os.environ.get("SLURM_JOB_ID") or None,
                   int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0), time.time(), uuid.uuid4().hex)

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" + (f" restart {self.slurm_restart}" if self.slurm_restart else "")
        return (f"pid {self.pid} on {self.host}{job if self.slurm_job_id else ''}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}")


def stale_reason(holder: Holder | None, age_s: float, me: Holder) -> str | None:
    """Why the lock of `holder` (None: unreadable), last refreshed `age_s` ago, may be taken over; None if not."""
    if age_s > STALE_AFTER_S:
        return f"its heartbeat is {age_s:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    if holder is None:
        return None
    if holder.host == me.host and not process_alive(holder.pid):
        return f"its process {holder.pid} on {holder.host} is gone"
    if me.slurm_job_id and holder.slurm_job_id == me.slurm_job_id and holder.slurm_restart < me.slurm_restart:
        return f"it is this Slurm job's earlier start (restart {holder.slurm_restart}, now {me.slurm_restart})"
    return None


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class RunLock:
    """A held lock on a run directory, kept fresh by a daemon thread until `release()`."""

    def __init__(self, path: Path, holder: Holder, created: Path | None = None):
        self.path, self.holder, self.created = path, holder, created
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, run: RunDir, note=print) -> RunLock:
        """Take the lock of the run directory (created if missing), taking over a stale one; RunDirLocked if it is
        held."""
        me, run_dir, path = Holder.here(), run.root, run.lock
        created = next((p for p in reversed([run_dir, *run_dir.parents]) if not p.exists()), None)
        run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # another start may take, release or replace the lock between our steps
            if _link_new(path, me):
                return cls(path, me, created)
            try:
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile
            holder = read_holder(path)
            why = stale_reason(holder, age, me)
            if why is None:
                _remove_created(created, run_dir)
                who = holder.describe() if holder else "an unreadable lock"
                raise RunDirLocked(
                    f"{run_dir} is in use by another run ({who}; heartbeat {age:.0f} s ago): wait for it to end "
                    f"or use another train.run_dir; if that run is surely gone, delete {path} (it is taken over "
                    f"by itself once its heartbeat is {STALE_AFTER_S:.0f} s old)")
            if _take_away(path, holder):
                note(f"note: took over the lock of {run_dir} from "
                     f"{holder.describe() if holder else 'an unreadable lock'}: {why}")
        _remove_created(created, run_dir)
        raise RunDirLocked(f"{run_dir}: could not take {path}: other runs keep taking it; start one run at a time")

    def owned(self) -> bool:
        """Whether the lock file is still this acquisition's (not released, not taken over)."""
        holder = read_holder(self.path)
        return holder is not None and holder.token == self.holder.token

    def release(self) -> None:
        """Stop the heartbeat, delete the lock if it is still ours, and the directories acquire() made if empty."""
        self._stop.set()
        if self.owned():
            self.path.unlink(missing_ok=True)
        _remove_created(self.created, self.path.parent)
        self.created = None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.owned():
                    holder = read_holder(self.path)
                    log.warning("the lock of %s was taken over by %s: two runs now write there", self.path.parent,
                                holder.describe() if holder else "another run")
                    return
                os.utime(self.path)
            except OSError:
                pass  # a filesystem hiccup: the next beat tries again, and staleness allows several missed


def lock_run_dir(run: RunDir, rank0: bool) -> RunLock | None:
    """Rank 0 takes the lock of the run directory and returns it (None on other ranks); every rank calls this, and
    every rank raises RunDirLocked with rank 0's message when it is refused."""
    lock, refusal = None, None
    if rank0:
        try:
            lock = RunLock.acquire(run)
        except RunDirLocked as e:
            refusal = str(e)
        except OSError as e:  # a read-only or missing parent: the run cannot write there anyway
            refusal = f"cannot use {run.root} as the run directory: {e.strerror or e} ({e.filename or run.root})"
    if dist.is_initialized() and dist.get_world_size() > 1:
        refusal = all_gather_objects(refusal)[0]
    if refusal:
        raise RunDirLocked(refusal)
    return lock


def read_holder(path: Path) -> Holder | None:
    """The holder a lock file names, or None if it is missing or unreadable."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _link_new(path: Path, me: Holder) -> bool:
    """Create `path` holding `me` atomically; False if it exists.

    The content is written to a file of its own first and hard-linked onto the lock's name, so a lock is
    never seen half-written. On NFS a link whose reply was lost reports an error although it was made: the
    link count of our own file tells.
    """
    own = path.with_name(f".{path.name}.{me.token}")
    own.write_text(json.dumps(asdict(me)) + "\n")
    try:
        os.link(own, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        if own.stat().st_nlink == 2:
            return True
        raise
    finally:
        own.unlink(missing_ok=True)


def _take_away(path: Path, stale: Holder | None) -> bool:
    """Remove the stale lock that names `stale`, unless another start replaced it meanwhile."""
    aside = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return True  # released or taken away meanwhile: try again
    moved = read_holder(aside)
    if (moved and moved.token) != (stale and stale.token):
        # A fresh lock of a start that got in first: put it back (unless yet another took the name).
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def _remove_created(created: Path | None, run_dir: Path) -> None:
    """Remove the directories from `run_dir` up to `created` (the first one acquire() made), where empty."""
    if created is None:
        return
    for folder in [run_dir, *run_dir.parents]:
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == created:
            return
