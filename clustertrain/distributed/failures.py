"""The first real error of any rank, shown once and recorded: failing ranks publish theirs on the process
group's key-value store (no shared filesystem needed, nothing written to disk).

A rank other than 0 whose error is the user's (bad data in its share, a file only it reads) publishes it and
waits a moment for rank 0 to show it; if rank 0 is stuck in a collective, the rank shows it itself. Rank 0
reports its own user error; any other error of its own (often only the dropped connection of the peer that
failed first) gives way to the earliest error published, which rank 0 then records in `status.json` and shows
once on the terminal. A rank other than 0 whose error is not the user's, when another rank failed before it
(rank 0's bad line broke its collective), stays quiet: that error is reported where it happened. A broken
connection that no rank explains (a rank killed by SIGKILL or the OOM killer) is no traceback: rank 0 says so in
one line, and the launcher, which saw how that rank ended, names it.

Whoever shows an error claims that atomically on the store and prints at once: a launcher that ends the other
ranks when one exits (torchrun, srun) may end the claimant a moment later. Rank 0 usually hosts the store, so
after closing its process group (which breaks the others' collectives) it keeps the store up until every rank
has published, for at most SHOW_WAIT_S (`let_peers_report`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch.distributed as dist

from clustertrain.errors import ExitCode, UserError

_PREFIX = "clustertrain/failures/"
_SHOWN = _PREFIX + "shown"  # the rank that showed an error on the terminal
SHOW_WAIT_S = 2.0  # how long a failing rank waits for rank 0 to show its error; rank 0 waits as long for peers'
VANISHED = -1  # the rank of a failure no rank reported: one died without a word (see _vanished_peer)
_CONNECTION_LOST = re.compile(r"connection (?:reset|closed) by peer|broken pipe|remote process exited|"
                              r"connection refused", re.IGNORECASE)


@dataclass
class RankFailure:
    """One rank's error, as published on the store."""

    rank: int
    time: float
    kind: str  # the exception's class name
    message: str  # a UserError's one line; the first line of any other error
    exit_code: int
    user: bool  # a UserError: shown in one line, without a traceback
    shown: bool = False  # printed already, by the rank that had it

    @classmethod
    def of(cls, rank: int, error: BaseException) -> RankFailure:
        user = isinstance(error, UserError)
        message = str(error) if user else (str(error).strip().splitlines() or [""])[0][:300]
        return cls(rank, time.time(), type(error).__name__, message, error.exit_code if user else ExitCode.FAILED, user)

    def __str__(self) -> str:  # for status.json
        if self.rank == VANISHED:  # the message names the rank; the kind is only what the reporter saw of it
            return self.message
        return f"{self.kind}: {self.message}" + (f" (rank {self.rank})" if self.rank > 0 else "")

    def line(self) -> str:
        """What the terminal shows: a user error's own line; another rank's other error named, with its rank."""
        if self.user or self.rank == VANISHED:
            return self.message
        return (f"rank {self.rank} failed first with {self.kind}: {self.message} "
                "(its traceback is in that rank's output)")


class PeerFailed(UserError):
    """This rank stops because another rank failed first: the message is that rank's error."""

    def __init__(self, failure: RankFailure):
        super().__init__(failure.line())
        self.exit_code = failure.exit_code
        self.shown = failure.shown


def first_failure(error: BaseException, vanished: Callable[[], str | None] | None = None) -> RankFailure:
    """Publish this rank's `error` and return the error to report; `shown` if it is on the terminal already.

    Rank 0: its own if it is a user error, else the earliest of any rank's. Other ranks: their own user error,
    shown here if rank 0 has not shown one within SHOW_WAIT_S; an error that came after another rank's (a
    collective it broke) gives way to that one, which rank 0 reports. A UserError shown here is marked
    `shown = True` for the CLI. `vanished` names the ranks that died without a word (the watchdog's heartbeats),
    when a connection broke and no rank said why."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    own = RankFailure.of(rank, error)
    store = _store()
    if store is None:
        return own
    # A peer's connection breaks when the rank at the other end exits: if that is rank 0, the store it hosts
    # (`--nproc`, srun) goes with it, and torch's C++ client would print a warning for the call that finds it gone.
    quiet = _native_stderr_muted() if rank != 0 and _lost_connection(own) else contextlib.nullcontext()
    try:
        with quiet:
            first = _first_on_rank0(store, own) if rank == 0 else _first_on_peer(store, own)
    except (RuntimeError, OSError, ValueError):  # the store went down with rank 0, or timed out
        first = own
    if first is own and _lost_connection(own):
        return _vanished_peer(own, say=rank == 0, vanished=vanished if rank == 0 else None)
    if first is own and own.shown:
        error.shown = True  # type: ignore[attr-defined]  # read by the CLI, which then prints nothing more
    return first


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """Send what native code writes to stderr (file descriptor 2) to /dev/null meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _lost_connection(failure: RankFailure) -> bool:
    """Whether the failure is a rank's connection to another one breaking (gloo, NCCL, the store)."""
    return not failure.user and (failure.kind == "DistNetworkError" or bool(_CONNECTION_LOST.search(failure.message)))


def _vanished_peer(own: RankFailure, say: bool, vanished: Callable[[], str | None] | None) -> RankFailure:
    """No rank reported an error, yet a connection broke: a rank died without a word (SIGKILL, the OOM killer, a
    crash in C), and whoever started it (the `--nproc` launcher, srun, torchrun) reports how it ended. This rank
    stays quiet about the dropped connection; rank 0 says so in one line (a rank that lost rank 0 with its store
    stays quiet too: rank 0 showed its error before it left, or its launcher names it). `vanished` names the
    dead rank from its heartbeat where it can."""
    named = vanished() if vanished else None
    failure = RankFailure(VANISHED, own.time, own.kind, named or f"rank {own.rank} lost its connection to another "
                          "rank, which stopped without reporting an error (killed? out of memory?); its launcher's "
                          "output names it", exit_code=ExitCode.FAILED, user=False, shown=True)
    if say:
        print(f"error: {failure.line()}", file=sys.stderr, flush=True)
    return failure


def _first_on_rank0(store: dist.Store, own: RankFailure) -> RankFailure:
    global _lingering
    _lingering = store, dist.get_world_size()
    _publish(store, own)
    first = own  # a user error of its own is real, whatever the others had (often the same one, on every rank)
    if not own.user:
        _wait_for(lambda: _count(store) > 1)  # most likely a peer failed first: let its record in
        # a real error before a broken connection, which is only what a rank saw of another one's end
        first = min(published_failures(store), key=lambda f: (_lost_connection(f), f.time, f.rank))
        if _lost_connection(first):
            return own  # no rank reported why: first_failure says so
    if first.user or first.rank != 0:  # rank 0's own other error: Python's traceback, on the way out
        shown_by = _show(store, first)
        if shown_by != 0:  # a peer that waited for rank 0 in vain showed its own, earlier error: that is the first
            first = next((f for f in published_failures(store) if f.rank == shown_by), first)
        first.shown = True
    return first


def _first_on_peer(store: dist.Store, own: RankFailure) -> RankFailure:
    if not own.user:  # read before publishing: rank 0 may leave once every rank has published
        earlier = [f for f in published_failures(store) if f.time <= own.time]
        if earlier:
            first = min(earlier, key=lambda f: (f.time, f.rank))
            first.shown = True  # by the rank that had it, or by rank 0
            _publish(store, own)
            return first
    _publish(store, own)
    if own.user:
        if not _wait_for(lambda: store.check([_SHOWN])):
            _show(store, own)
        own.shown = True  # here, or rank 0 showed an error (this one, or an earlier one)
    return own


def _show(store: dist.Store, failure: RankFailure) -> int:
    """Print `failure` unless a rank has shown an error already (the claim on the store makes it once); returns
    the rank that showed one."""
    me = str(dist.get_rank()).encode()
    shown_by = store.compare_set(_SHOWN, "", me)
    if shown_by == me:
        print(f"error: {failure.line()}", file=sys.stderr, flush=True)
    return int(shown_by)


def let_peers_report() -> None:
    """Rank 0, after a failure and once its process group is closed: keep the store up until every rank has
    published its error (their collectives broke when the group closed), for at most SHOW_WAIT_S."""
    global _lingering
    if _lingering is None:
        return
    (store, world_size), _lingering = _lingering, None
    with contextlib.suppress(RuntimeError, OSError, ValueError):
        _wait_for(lambda: _count(store) >= world_size)


_lingering: tuple[dist.Store, int] | None = None  # rank 0's store and world size, held for let_peers_report


def _publish(store: dist.Store, failure: RankFailure) -> None:
    store.set(f"{_PREFIX}{store.add(_PREFIX + 'count', 1)}", json.dumps(asdict(failure)))


def _count(store: dist.Store) -> int:
    return store.add(_PREFIX + "count", 0)


def published_failures(store: dist.Store) -> list[RankFailure]:
    keys = [f"{_PREFIX}{i}" for i in range(1, _count(store) + 1)]
    # check() first: a key counted but not yet set (its rank is between add and set) would block get()
    return [RankFailure(**json.loads(store.get(key))) for key in keys if store.check([key])]


def _store() -> dist.Store | None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def _wait_for(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + SHOW_WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
