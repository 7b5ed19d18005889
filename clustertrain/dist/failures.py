"""The first real error of any rank, shown once and recorded: failing ranks publish theirs on the process
group's key-value store (no shared filesystem needed, nothing written to disk).

A rank other than 0 whose error is the user's (bad data in its share, a file only it reads) publishes it and
waits a moment for rank 0 to show it; if rank 0 is stuck in a collective, the rank shows it itself. Rank 0
reports its own user error; any other error of its own (often only the dropped connection of the peer that
failed first) gives way to the earliest error published, which rank 0 then records in `status.json` and shows
once on the terminal.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch.distributed as dist

from clustertrain.errors import UserError

_PREFIX = "clustertrain/failures/"
SHOW_WAIT_S = 2.0  # how long a failing rank waits for rank 0 to show its error; rank 0 waits as long for peers'


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
        return cls(rank, time.time(), type(error).__name__, message, error.exit_code if user else 1, user)

    def __str__(self) -> str:  # for status.json
        return f"{self.kind}: {self.message}" + (f" (rank {self.rank})" if self.rank else "")


class PeerFailed(UserError):
    """Rank 0 stops because another rank failed first: the message is that rank's error."""

    def __init__(self, failure: RankFailure):
        super().__init__(failure.message if failure.user else f"rank {failure.rank} failed first with {failure.kind}: "
                         f"{failure.message} (its traceback is in that rank's output)")
        self.exit_code = failure.exit_code
        self.shown = failure.shown


def first_failure(error: BaseException) -> RankFailure:
    """Publish this rank's `error` and return the error to report. Rank 0: its own if it is a user error, else
    the earliest of any rank's. Other ranks: their own, shown here if rank 0 has not shown one within SHOW_WAIT_S."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    own = RankFailure.of(rank, error)
    store = _store()
    if store is None:
        return own
    shown = _PREFIX + "shown"
    try:
        store.set(f"{_PREFIX}{store.add(_PREFIX + 'count', 1)}", json.dumps(asdict(own)))
        if rank != 0:
            if own.user and not _wait_for(lambda: store.check([shown])):
                print(f"error: {own.message}", file=sys.stderr, flush=True)
                store.set(shown, str(rank))
                own.shown = True
            return own
        if own.user:  # real, whatever the others had (often the same error, on every rank)
            store.set(shown, "0")
            return own
        _wait_for(lambda: store.add(_PREFIX + "count", 0) > 1)  # most likely a peer failed first: let its record in
        count = store.add(_PREFIX + "count", 0)
        failures = [RankFailure(**json.loads(store.get(f"{_PREFIX}{i}"))) for i in range(1, count + 1)]
        first = min(failures, key=lambda f: (f.time, f.rank))
        first.shown = first.rank != 0 and store.check([shown])
        if first.user:
            store.set(shown, "0")  # rank 0 shows it (now, or through its own exception): the others keep quiet
        return first
    except (RuntimeError, OSError, ValueError):  # the store went down with rank 0, or timed out
        return own


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
