"""The hang report: who is stuck, read from every rank's last heartbeat (distributed/watchdog.py writes them and
calls `diagnose` on the reporting rank), in one line that names the rank, its host, pid and phase."""

from __future__ import annotations

import time
from typing import Any


def diagnose(beats: dict[int, dict[str, Any]], stale: list[int], world_size: int, me: int, why: str
             ) -> dict[str, Any]:
    """Who is stuck, from every rank's last heartbeat: ranks that stopped beating (in the step the others wait
    in, where their heartbeat lags behind it); else ranks outside a collective while others wait in one; else the
    ranks behind the others' step; else ranks outside any collective; else none (all wait)."""
    missing = [r for r in range(world_size) if r not in beats]
    silent = sorted({*stale, *missing})
    live = {r: b for r, b in beats.items() if r not in silent}
    busy = [r for r, b in live.items() if not b.get("waiting")]
    waiting = [r for r, b in live.items() if b.get("waiting")]
    steps = {b.get("step", 0) for b in live.values()}
    mine = beats.get(me, {})
    if silent:
        stuck = silent
        ahead = max(live.values(), key=lambda b: b.get("step", 0), default={})  # where the others wait for it
        what = "; ".join(_stopped(r, beats[r], ahead) if r in beats else f"rank {r} never beat" for r in silent)
        what += " (stopped, killed, or its node hangs)"
    elif busy and waiting:
        stuck = sorted(busy)
        what = _stuck_at(live, stuck) + f", while {_ranks(waiting)} {_verb(waiting, 'waits', 'wait')} in a collective"
    elif len(steps) > 1:
        stuck = sorted(r for r, b in live.items() if b.get("step", 0) == min(steps))
        what = (f"{_ranks(stuck)} {_verb(stuck, 'is', 'are')} behind, in step {min(steps)}, "
                f"the others in step {max(steps)}")
    elif busy:  # a single rank, or every rank stuck outside the collectives (a frozen file system)
        stuck = sorted(busy)
        what = _stuck_at(live, stuck) + ", outside any collective"
    else:
        stuck = []
        what = "every rank waits in a collective (a deadlock or a network fault: see the stacks)"
    hosts = sorted({beats[r]["host"] for r in stuck if r in beats and beats[r].get("host")})
    return {"time": time.time(), "line": f"hang: {what}; rank {me} waited {why}; stacks in the run's hang/ folder",
            "stuck_ranks": stuck, "stuck_hosts": hosts, "phase": mine.get("phase"), "step": mine.get("step"),
            "reporter": me}


def _stuck_at(live: dict[int, dict[str, Any]], stuck: list[int]) -> str:
    return "; ".join(f"rank {r} ({host_pid(live[r])}) is stuck in {phase_of(live[r])} at {live[r]['where']}"
                     for r in stuck)


def _stopped(rank: int, beat: dict[str, Any], ahead: dict[str, Any]) -> str:
    """A silent rank, in the step the others wait in when its heartbeat (written every few seconds) lags."""
    said = f"rank {rank} ({host_pid(beat)}) stopped beating {age(beat)} s ago, in "
    if ahead.get("step", 0) > beat.get("step", 0):  # the others cannot pass a step's collectives without it
        return (f"{said}{phase_of(ahead)}, where the others wait for it, after its last heartbeat from "
                f"{phase_of(beat)}")
    return said + phase_of(beat)


def host_pid(beat: dict[str, Any]) -> str:
    """Where a heartbeat's rank runs: "host n1, pid 4242"."""
    return f"host {beat.get('host', '?')}, pid {beat.get('pid', '?')}"


def phase_of(beat: dict[str, Any]) -> str:
    """The phase a heartbeat's rank is in: "step 7", "checkpoint save"."""
    phase = beat.get("phase", "?")
    return f"{phase} {beat.get('step')}" if phase in ("step", "first step") else str(phase)


def age(beat: dict[str, Any]) -> str:
    """Seconds since a heartbeat was written, whole."""
    return f"{max(0.0, time.time() - beat.get('time', time.time())):.0f}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _verb(ranks: list[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many
