"""The hang watchdog: a rank stuck in one phase of the run past that phase's timeout ends the job with a report
that names the stuck rank, instead of the collective timeout's traceback (gloo) or a job left "running" (NCCL).

Each rank runs a thread that
- every `watchdog.heartbeat_s` writes `heartbeats/rank-N.json`: the step, the phase and since when, the main
  thread's innermost frame, and whether the main thread waits in a collective (its frame is in torch.distributed,
  DDP or autograd);
- about every second compares the main thread's time in its phase with the phase's timeout (`timeout`).

On a hang each live rank writes every thread's Python stacks (and on NCCL the flight recorder's record) into
`hang/` and marks its heartbeat "hung"; the first also writes `hang/began.json`. The lowest rank still beating
waits until every other rank has done the same or has stopped beating, then names the stuck rank (hang_report)
in one line, in `hang/report.json` and, by the trainer's `on_hang`, in status.json; the others wait for that
report (reading only the heartbeats below them, up to the first live one: a few files each, not world² reads at
scale). Every rank exits with ExitCode.HUNG (76), which the Slurm path requeues. A rank whose collective breaks
because a peer ended for a hang joins it (`join_hang`, from `hang/began.json`), and a rank that died without a
word (SIGKILL, the OOM killer) is named by its missing heartbeat (`vanished`).

The phase clocks count the time the process ran: when the thread wakes SUSPEND_GAP_S or more later than it asked
and the process used almost no CPU meanwhile, the process was stopped (Ctrl-Z, `scontrol suspend`, a paused VM),
and that time does not count. A job stopped as a whole and continued trains on; a rank stopped alone is still
named by its peers, whose clocks ran. Before it exits, a hung rank ends the processes it started (DataLoader
workers): `os._exit` skips their shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from clustertrain.config.schema import WatchdogConfig
from clustertrain.distributed.env import node_name
from clustertrain.distributed.spawn import end_descendants
from clustertrain.errors import ExitCode
from clustertrain.distributed.hang_report import age, diagnose, host_pid, phase_of
from clustertrain.files import read_json_object, write_atomic
from clustertrain.run_dir import RunDir

STALE_BEATS = 2.5  # a heartbeat unchanged for this many periods is stale: its rank is stopped, dead or cut off
SUSPEND_GAP_S = 2.0  # the thread woke this much later than it asked, the process idle: it was stopped
VANISHED_WAIT_S = 5.0  # how long rank 0 looks for a dead peer before it reports: launchers end it soon after
_WAITING_IN = ("/torch/distributed/", "/torch/nn/parallel/", "/torch/autograd/")  # a main thread here waits on peers


class Watchdog:
    """One rank's watchdog. The trainer names each phase as it enters it (`phase`), reports finished steps
    (`step_done`), starts the heartbeat files once the run has started (`start_beating`) and closes it last.

    Example:
        >>> watchdog = Watchdog(config.watchdog, files, rank=0, world_size=2, on_hang=record)  # files: the RunDir
        >>> watchdog.phase("step", 1)
    """

    def __init__(self, config: WatchdogConfig, run: RunDir, rank: int, world_size: int,
                 on_hang: Callable[[dict[str, Any]], None], nccl: bool = False):
        self.config, self.run, self.rank, self.world_size = config, run, rank, world_size
        self.on_hang, self.nccl = on_hang, nccl
        self.host, self.pid = node_name(), os.getpid()
        self.step_s: deque[float] = deque(maxlen=100)
        self._stopped_s = 0.0  # how long the process was stopped (SIGSTOP, a suspended job): not run time
        # (name, step, wall-clock start, run-clock start): one tuple, replaced whole, read by the thread
        self._phase: tuple[str, int, float, float] = ("start-up", 0, time.time(), self._clock())
        self._hang_began = 0.0
        # Heartbeats older than this are an earlier launch's: every rank's watchdog starts after the process group,
        # so after every rank of this launch has started (a few seconds allowed for clocks across hosts).
        self._launched = time.time() - 2.0
        self.beating = False
        self.hung = False
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="clustertrain-watchdog", daemon=True)
        if config.enabled:
            self._thread.start()

    # ---- what the main thread says -----------------------------------------------------------------
    def phase(self, name: str, step: int | None = None) -> None:
        """The main thread enters phase `name` (see `timeout`), at `step` if given."""
        self._phase = (name, self._phase[1] if step is None else step, time.time(), self._clock())

    def step_done(self) -> None:
        """The step phase that began at the last `phase` call ended: its duration feeds the median."""
        self.step_s.append(self._clock() - self._phase[3])

    def timeout(self, name: str) -> float | None:
        """Seconds phase `name` may last; None: no limit (rank 0 prepares data and reports on that itself)."""
        c = self.config
        if name == "step":
            median = statistics.median(self.step_s) if self.step_s else 0.0
            return max(c.step_timeout_s, c.step_timeout_factor * median)
        return {"start-up": c.startup_timeout_s, "first step": c.first_step_timeout_s, "evaluation": c.eval_timeout_s,
                "checkpoint save": c.save_timeout_s, "closing": c.save_timeout_s}.get(name)

    def start_beating(self) -> None:
        """Write heartbeat files from now on (the run holds its directory: a refused start writes none)."""
        if self.config.enabled:
            self.beating = True
            self._beat("running")

    def close(self) -> None:
        """Stop the thread; the last heartbeat says this rank ended (so its peers do not take it for dead)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.beating and not self.hung:
            with contextlib.suppress(OSError):
                self._beat("ended")
            self.beating = False

    # ---- the thread ----------------------------------------------------------------------------------
    def _clock(self) -> float:
        """Seconds the process ran (a monotonic clock less the time it was stopped): what phases are timed by."""
        return time.monotonic() - self._stopped_s

    def _watch(self) -> None:
        period = self.config.heartbeat_s
        tick = min(1.0, period / 2)
        next_beat = 0.0
        while True:
            asked, cpu = time.monotonic(), time.process_time()
            if self._stop.wait(tick):
                break
            self._count_stop(time.monotonic() - asked - tick, time.process_time() - cpu)
            if self.beating and time.monotonic() >= next_beat:
                with contextlib.suppress(OSError):  # a full or slow disk must not end the run; a hang will
                    self._beat("running")
                next_beat = time.monotonic() + period
            now = self._clock()
            name, _, _, started = self._phase
            limit = self.timeout(name)
            if limit is not None and now - started > limit:
                self._end_hung(f"{now - started:.0f} s in {self._phase_name()} (limit {limit:.0f} s)")

    def _count_stop(self, late_s: float, cpu_s: float) -> None:
        """The thread woke `late_s` later than it asked, the process having used `cpu_s` of CPU meanwhile: late
        and idle, the whole process was stopped, and that time is not run time. Only the wait is measured, not the
        heartbeat's write (a slow disk is no stop); a thread kept from the GIL by a busy main thread uses CPU."""
        if late_s >= SUSPEND_GAP_S and cpu_s < late_s / 2:
            self._stopped_s += late_s

    def _phase_name(self) -> str:
        name, step, _, _ = self._phase
        return f"{name} {step}" if name in ("step", "first step") else name

    def _beat(self, state: str) -> None:
        where, waiting = self._main_frame()
        name, step, since, _ = self._phase
        beat = {"rank": self.rank, "host": self.host, "pid": self.pid, "state": state, "step": step,
                "phase": name, "phase_started": since, "time": time.time(), "where": where,
                "waiting": waiting, "step_s": statistics.median(self.step_s) if self.step_s else None,
                "period_s": self.config.heartbeat_s}
        path = self.run.heartbeat(self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(beat) + "\n")

    def _stacks(self) -> str:
        """Every thread's Python stack, the main thread's first."""
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = sys._current_frames()
        return "\n".join(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                         + "".join(traceback.format_stack(frames[ident]))
                         for ident in sorted(frames, key=lambda ident: ident != self._main))

    def _main_frame(self) -> tuple[str, bool]:
        """Where the main thread is (its innermost frame, and the innermost of clustertrain's below it when that
        differs) and whether it waits in a collective."""
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "?", False
        ours = next((f for f in _outward(frame) if "/clustertrain/" in f.f_code.co_filename), None)
        where = _describe(frame) + (f", from {_describe(ours)}" if ours not in (None, frame) else "")
        return where, any(part in frame.f_code.co_filename for part in _WAITING_IN)

    # ---- a hang --------------------------------------------------------------------------------------
    def join_hang(self) -> None:
        """Called by the main thread on its way out with an error: if this rank or a peer ended for a hang (the
        error is the broken collective that caused), end as part of that hang instead; else return."""
        if not self.beating:
            return
        if self.hung:
            while True:  # the watchdog thread ends the process
                time.sleep(1)
        if _read(self.run.hang_began).get("time", 0) >= self._launched:  # one file, not every rank's heartbeat
            self._end_hung(f"a peer ended for a hang while this rank was in {self._phase_name()}")

    def _end_hung(self, why: str) -> None:
        """Write this rank's stacks, report (the lowest rank still beating) or wait for the report, and exit
        ExitCode.HUNG."""
        self.hung = True
        self._hang_began = time.time()
        self.run.hang.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            self.run.hang_stacks(self.rank).write_text(
                f"rank {self.rank} on {self.host} (pid {self.pid}): {why}\n\n{self._stacks()}")
            if self.nccl:
                _dump_flight_recorder(self.run.hang / f"flight-rank-{self.rank:05d}.pkl")
        with contextlib.suppress(OSError):
            self._beat("hung")
            if _read(self.run.hang_began).get("time", 0) < self._launched:
                write_atomic(self.run.hang_began, json.dumps({"rank": self.rank, "time": self._hang_began}) + "\n")
        watch = _Staleness(STALE_BEATS * self.config.heartbeat_s)
        if self._hung_below(watch) is None:
            self._report(why, watch)
        else:
            self._wait_for_report()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        end_descendants()  # os._exit skips the DataLoader's shutdown: its workers would live on, orphaned
        os._exit(ExitCode.HUNG)

    def _hung_below(self, watch: _Staleness) -> int | None:
        """A lower rank that is hung too, which reports (or defers to a rank below it); None when every lower rank
        has ended or stopped beating, or the wait ends: this rank reports. Heartbeats are read from rank 0 up to
        the first live one only, so that on a hang each rank reads a few files, not every rank's."""
        deadline = time.monotonic() + (STALE_BEATS + 1) * self.config.heartbeat_s
        while time.monotonic() < deadline:
            for rank in range(self.rank):
                beat = _read(self.run.heartbeat(rank))
                if beat.get("time", 0) < self._launched:
                    beat = {}  # an earlier launch's
                if beat.get("state") == "hung":
                    return rank
                if beat.get("state") != "ended" and not watch.stale(rank, beat):
                    break  # still running: it will be hung, or go stale, soon
            else:
                return None
            time.sleep(min(0.5, self.config.heartbeat_s / 4))
        return None

    def _report(self, why: str, watch: _Staleness) -> None:
        """As the reporting rank: wait for the peers, name the stuck rank in hang/report.json, status.json (by
        `on_hang`) and one line on stderr."""
        beats, stale = self._wait_for_peers(watch)
        report = diagnose(beats, stale, self.world_size, self.rank, why)
        since = self._hang_began - (STALE_BEATS + 2) * self.config.heartbeat_s  # this hang's, not an earlier one's
        report["stacks"] = sorted(p.name for p in self.run.hang.glob("rank-*.txt") if p.stat().st_mtime >= since)
        with contextlib.suppress(Exception):  # the report must not stop the exit
            write_atomic(self.run.hang_report, json.dumps(report, indent=1) + "\n")
            self.on_hang(report)
        print(f"error: {report['line']}", file=sys.stderr, flush=True)

    def _wait_for_peers(self, watch: _Staleness) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """Read the heartbeats until every other rank is hung, ended or stale; returns them and the stale ranks."""
        period = self.config.heartbeat_s
        deadline = time.monotonic() + (STALE_BEATS + 1) * period
        while True:
            beats = read_beats(self.run, self.world_size)
            stale = watch.update(beats, self.rank)
            pending = [r for r in range(self.world_size) if r != self.rank and r not in stale
                       and beats.get(r, {}).get("state") not in ("hung", "ended")]
            if not pending or time.monotonic() > deadline:
                return beats, stale
            time.sleep(min(0.5, period / 4))

    def _wait_for_report(self) -> None:
        """Stay until the reporting rank has written this hang's report (a launcher ends every rank once one
        exits), at most as long as its own waits may take."""
        deadline = time.monotonic() + (2 * (STALE_BEATS + 1) + 1) * self.config.heartbeat_s
        while time.monotonic() < deadline and _read(self.run.hang_report).get("time", 0) < self._launched:
            time.sleep(min(0.5, self.config.heartbeat_s / 4))

    def vanished(self) -> str | None:
        """Rank 0, when a connection broke and no rank said why: the ranks that died without a word, named by their
        heartbeats within VANISHED_WAIT_S (a dead pid on this host; a rank still "running" once every other one
        has ended; a heartbeat gone stale); None if none is found by then."""
        if not self.beating:
            return None
        watch = _Staleness(STALE_BEATS * self.config.heartbeat_s)
        deadline = time.monotonic() + min(VANISHED_WAIT_S, (STALE_BEATS + 1) * self.config.heartbeat_s)
        while time.monotonic() < deadline:
            beats = read_beats(self.run, self.world_size)
            stale = watch.update(beats, self.rank)
            running = [r for r, b in beats.items() if r != self.rank and b.get("state") == "running"]
            dead = [r for r in running if beats[r].get("host") == self.host and not _pid_alive(beats[r].get("pid"))]
            others_ended = len(beats) == self.world_size and len(running) == 1
            gone = sorted({*dead, *(r for r in stale if r in running), *(running if others_ended else ())})
            if gone:
                return "; ".join(f"rank {r} ({host_pid(beats[r])}) died without a word (its last heartbeat, "
                                 f"{age(beats[r])} s ago, in {phase_of(beats[r])}; killed? out of memory? see "
                                 "`dmesg` on its host)" for r in gone)
            if not running:
                return None  # every peer said how it ended
            time.sleep(min(0.2, self.config.heartbeat_s / 4))
        return None


class _Staleness:
    """Which ranks' heartbeats have not changed for `after_s` seconds of this rank's clock (no clocks compared
    across hosts); a rank without a heartbeat file counts from the first look."""

    def __init__(self, after_s: float):
        self.after_s = after_s
        self.seen: dict[int, tuple[Any, float]] = {}

    def stale(self, rank: int, beat: dict[str, Any]) -> bool:
        """Whether `beat`, rank `rank`'s heartbeat as read now ({} when unreadable), has not changed for after_s."""
        now = time.monotonic()
        beat_time = beat.get("time")
        last, since = self.seen.get(rank, (beat_time, now))
        if beat_time != last:
            since = now
        self.seen[rank] = (beat_time, since)
        return now - since >= self.after_s and beat.get("state") != "ended"

    def update(self, beats: dict[int, dict[str, Any]], me: int) -> list[int]:
        """The stale ranks among `beats` (every rank's, as read now) and those seen before."""
        return sorted(r for r in {*beats, *self.seen} - {me} if self.stale(r, beats.get(r, {})))


def read_beats(run: RunDir, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's last heartbeat that can be read, by rank."""
    return {rank: beat for rank in range(world_size) if (beat := _read(run.heartbeat(rank)))}


def _read(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; {} if it is missing, half-read, not an object or not a regular file (a FIFO or a
    link to /dev/zero there never blocks the watchdog or fills its memory)."""
    with contextlib.suppress(OSError, ValueError):
        return read_json_object(path)
    return {}


def _outward(frame: FrameType | None):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _describe(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    for root in ("/clustertrain/", "/torch/", "/site-packages/"):
        if root in path:
            path = path[path.rindex(root) + 1:]
            break
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):  # a zombie has died; its parent has not yet reaped it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _dump_flight_recorder(path: Path) -> None:
    """NCCL's flight recorder: the last collectives each communicator ran, for torch's fr_trace analyzer."""
    with contextlib.suppress(Exception):  # absent in some builds; the Python stacks are written regardless
        import torch

        path.write_bytes(torch._C._distributed_c10d._dump_nccl_trace())
