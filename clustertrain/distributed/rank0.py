"""Rank 0 goes first: it builds what the other ranks then find ready (a trained tokenizer, source indexes) while
they wait on the process group's key-value store, not in a collective.

A barrier would hold the others for at most the collective timeout (`parallel.timeout_minutes`); training a
tokenizer on a large corpus takes longer, and NCCL's watchdog then ends every rank without a word. Instead rank 0
beats a heartbeat on the store while it works and ends with "done" or its error; the others wait as long as the
heartbeat goes on. Rank 0, which talks, says every PROGRESS_S what it is still doing; the waiting ranks stay quiet
unless the wait fails, then raise `WaitFailed` with one line:

- rank 0's build raised: its error, once rank 0 has published it for clustertrain/distributed/failures.py (which
  then reports rank 0's error as the run's, and this one not at all), or after SHOW_WAIT_S outside a training run;
- another rank published a failure (rank 0 failed before it got here, or a peer did): that failure;
- rank 0's heartbeat stopped for the store's timeout (the collective timeout): rank 0 hangs;
- the store stopped answering: rank 0, which hosts it under `--nproc` and srun, is gone.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TypeVar

import torch.distributed as dist

from clustertrain.distributed import failures
from clustertrain.distributed.failures import RankFailure

T = TypeVar("T")

_PREFIX = "clustertrain/rank0_first/"
PROGRESS_S = 60.0  # how often rank 0 says it is still at it
BEAT_S = 5.0  # rank 0's heartbeat period, at most a quarter of the store's timeout
POLL_S = 1.0  # the longest pause between a waiting rank's looks at the store
DONE = "done"


class WaitFailed(RuntimeError):
    """The other ranks' wait for rank 0 ended without its result: a rank failed, or rank 0 stopped answering."""


def rank0_first(what: str, build: Callable[[], T]) -> T:
    """Run `build` on rank 0, then on the other ranks, which wait for it on the store without a time limit while
    rank 0's heartbeat goes on; `what` ("preparing the tokenizer") names the work in progress lines and errors."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        return _build_first(store, _key(store), what, build)
    _wait_for_rank0(store, what)
    return build()


def _key(store: dist.Store) -> str:
    """This call's keys: every rank calls in the same order, so its own count of calls names the same ones."""
    return f"{_PREFIX}{store.add(f'{_PREFIX}calls/{dist.get_rank()}', 1)}/"


def _build_first(store: dist.Store, key: str, what: str, build: Callable[[], T]) -> T:
    outcome = DONE
    try:
        with _heartbeat(store, key, what):
            return build()
    except BaseException as e:
        outcome = json.dumps(asdict(RankFailure.of(0, e)))
        raise
    finally:
        with contextlib.suppress(RuntimeError, OSError):  # a store that is gone has no one waiting on it
            store.set(key + "result", outcome)


@contextlib.contextmanager
def _heartbeat(store: dist.Store, key: str, what: str) -> Iterator[None]:
    stop = threading.Event()
    period = min(BEAT_S, store.timeout.total_seconds() / 4)
    waiting = dist.get_world_size() - 1
    others = "the other rank waits" if waiting == 1 else f"the other {waiting} ranks wait"

    def beat() -> None:
        start = said = time.monotonic()
        with contextlib.suppress(RuntimeError, OSError):  # the store is gone: so are the ranks that waited
            while True:
                store.add(key + "beat", 1)
                if stop.wait(period):
                    return
                if time.monotonic() - said >= PROGRESS_S:
                    said = time.monotonic()
                    print(f"{what} on rank 0: {said - start:.0f} s so far; {others} for it", flush=True)

    thread = threading.Thread(target=beat, name="rank0-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _wait_for_rank0(store: dist.Store, what: str) -> None:
    limit_s = store.timeout.total_seconds()
    try:
        outcome = _poll(store, _key(store), limit_s)
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError: the store went down with rank 0
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise WaitFailed(f"rank 0 stopped answering while {what}: the process group's store is gone ({reason})"
                         ) from None
    if outcome == DONE:
        return
    if outcome is None:
        raise WaitFailed(f"rank 0 gave no sign of life for {limit_s:.0f} s (parallel.timeout_minutes) while "
                         f"{what}: it hangs or was stopped; see its output")
    if isinstance(outcome, str):  # rank 0's build raised
        failed, where = RankFailure(**json.loads(outcome)), what
        _wait_for_record(store)
    else:  # published before rank 0 finished: it failed before it got here, or another rank failed
        failed, where = outcome, f"this rank waited for rank 0 ({what})"
    raise WaitFailed(f"rank {failed.rank} failed while {where}: {failed.kind}: {failed.message}")


def _poll(store: dist.Store, key: str, limit_s: float) -> str | RankFailure | None:
    """Rank 0's outcome, the first failure any rank published, or None once rank 0's heartbeat stopped for
    `limit_s`."""
    beats, last_beat, pause = -1, time.monotonic(), 0.01
    while not store.check([key + "result"]):
        if published := failures.published_failures(store):
            return min(published, key=lambda f: (f.time, f.rank))
        now = time.monotonic()
        if (count := store.add(key + "beat", 0)) != beats:
            beats, last_beat = count, now
        elif now - last_beat > limit_s:
            return None
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
    return store.get(key + "result").decode()


def _wait_for_record(store: dist.Store) -> None:
    """In a training run rank 0 publishes its error next: wait for it (at most SHOW_WAIT_S), so that this rank's
    error comes after it and failures.py reports rank 0's as the run's, not this one."""
    deadline = time.monotonic() + failures.SHOW_WAIT_S
    with contextlib.suppress(RuntimeError, OSError):
        while not failures.published_failures(store) and time.monotonic() < deadline:
            time.sleep(0.02)
