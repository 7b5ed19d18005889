"""Faults that tests inject, to prove the watchdog and `clustertrain doctor` name the rank at fault.

    CLUSTERTRAIN_FAULT="collective@1:7=600"   # rank 1 sleeps 600 s inside step 7's loss all-reduce
    CLUSTERTRAIN_FAULT="matmul@1=0.05,network@0=0.02"   # doctor: rank 1's matmuls, rank 0's collectives slowed
    CLUSTERTRAIN_FAULT="start@0:0=1"   # Slurm: at SLURM_RESTART_COUNT 0, rank 0 exits 1 before its run starts

Each entry is POINT@RANK[:STEP]=SECONDS; for `start` it is start@RANK[:RESTART]=EXIT_CODE: the failed start that
`slurm.max_start_retries` retries (`clustertrain train` checks it before the trainer, so before any process group).
The variable is for tests only: nothing else sets it, and a run without it pays one dictionary lookup per point.
"""

from __future__ import annotations

import os
import sys
import time
from functools import cache

FAULT_ENV = "CLUSTERTRAIN_FAULT"
POINTS = ("collective", "matmul", "network", "start")


@cache
def _faults(spec: str) -> dict[tuple[str, int], tuple[int | None, float]]:
    faults = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        try:
            where, seconds = entry.split("=")
            point, at = where.split("@")
            rank, _, step = at.partition(":")
            assert point in POINTS
            faults[point, int(rank)] = (int(step) if step else None, float(seconds))
        except (ValueError, AssertionError):
            raise ValueError(f"{FAULT_ENV}={spec!r}: {entry!r} is not POINT@RANK[:STEP]=SECONDS with POINT one of "
                             f"{', '.join(POINTS)}") from None
    return faults


def delay(point: str, rank: int, step: int | None = None) -> None:
    """Sleep here if a test asked this rank to (at this step, where the fault names one)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    fault = _faults(spec).get((point, rank))
    if fault and fault[0] in (None, step):
        time.sleep(fault[1])


def fail_start() -> None:
    """Exit here, before the run starts, if a test asked this rank to at this Slurm restart (`start@RANK:RESTART`)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or "start@" not in spec:
        return
    from clustertrain.distributed.env import detect_launcher

    rank, restart = detect_launcher().rank, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    fault = _faults(spec).get(("start", rank))
    if fault and fault[0] in (None, restart):
        print(f"clustertrain: {FAULT_ENV}: rank {rank} fails its start (restart {restart}) with exit code "
              f"{int(fault[1])}", file=sys.stderr, flush=True)
        raise SystemExit(int(fault[1]))
