"""The watchdog's rules in-process: phase timeouts, who is stuck from the heartbeats, and staleness by change; and
in a real process stopped past its limit, that the time it did not run does not count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from clustertrain.config.schema import WatchdogConfig
from clustertrain.distributed import watchdog as wd
from clustertrain.distributed.hang_report import diagnose
from clustertrain.run_dir import RunDir


def beat(rank: int, step: int = 7, waiting: bool = True, **extra) -> dict:
    return {"rank": rank, "host": f"node{rank}", "pid": 100 + rank, "state": "hung", "step": step, "phase": "step",
            "time": time.time(), "where": "a.py:1 in f", "waiting": waiting, **extra}


@pytest.mark.parametrize("beats, stale, stuck, words", [
    ({0: beat(0), 1: beat(1)}, [1], [1], "rank 1 (host node1, pid 101) stopped beating"),
    # its heartbeat lags (one every few seconds): it stopped in the step the others wait in, not its beat's
    ({0: beat(0, step=9), 1: beat(1, step=7)}, [1], [1],
     "s ago, in step 9, where the others wait for it, after its last heartbeat from step 7"),
    ({0: beat(0)}, [], [1], "rank 1 never beat"),
    ({0: beat(0), 1: beat(1, waiting=False), 2: beat(2)}, [], [1], "while ranks 0, 2 wait in a collective"),
    ({0: beat(0, step=8), 1: beat(1, step=7), 2: beat(2, step=8)}, [], [1], "rank 1 is behind, in step 7"),
    ({0: beat(0), 1: beat(1)}, [], [], "every rank waits in a collective"),
    ({0: beat(0, waiting=False), 1: beat(1, waiting=False)}, [], [0, 1],  # none in a collective: none is named
     "rank 1 (host node1, pid 101) is stuck in step 7 at a.py:1 in f, outside any collective"),
])
def test_the_stuck_rank_is_named_from_the_heartbeats(beats, stale, stuck, words):
    world = 3 if 2 in beats else 2
    report = diagnose(beats, stale, world, 0, "5 s in step 7 (limit 4 s)")
    assert report["stuck_ranks"] == stuck and words in report["line"], report["line"]
    assert report["stuck_hosts"] == [f"node{r}" for r in stuck if r in beats]
    assert report["line"].startswith("hang: ") and "\n" not in report["line"]


def watchdog(tmp_path, **config) -> wd.Watchdog:
    return wd.Watchdog(WatchdogConfig(enabled=False, **config), RunDir(tmp_path), 0, 2, on_hang=lambda r: None)


def test_a_step_may_take_the_floor_or_the_factor_times_the_median(tmp_path):
    dog = watchdog(tmp_path, step_timeout_s=5, step_timeout_factor=10, first_step_timeout_s=99, save_timeout_s=7)
    assert dog.timeout("step") == 5
    dog.step_s.extend([0.1, 2.0, 0.2])  # median 0.2 s: the floor still rules
    assert dog.timeout("step") == 5
    dog.step_s.extend([2.0, 2.0])  # median 2 s
    assert dog.timeout("step") == 20
    assert (dog.timeout("first step"), dog.timeout("checkpoint save"), dog.timeout("data preparation")) == (99, 7, None)


def test_step_done_measures_from_the_phase_it_ends(tmp_path):
    dog = watchdog(tmp_path)
    dog.phase("step", 3)
    time.sleep(0.05)
    dog.step_done()
    assert 0.05 <= dog.step_s[-1] < 1


def test_a_heartbeat_is_stale_when_it_stops_changing_not_by_its_clock():
    watch = wd._Staleness(after_s=0.2)
    old = {1: beat(1, time=1.0, state="running"), 2: beat(2, time=1.0, state="ended")}  # clocks far behind ours
    assert watch.update(old, me=0) == []
    time.sleep(0.25)
    assert watch.update({**old, 1: beat(1, time=1.5, state="running")}, me=0) == []  # it changed: alive
    time.sleep(0.25)
    assert watch.update({**old, 1: beat(1, time=1.5, state="running")}, me=0) == [1]  # an ended rank is never stale


def test_heartbeats_start_only_with_the_run_and_end_marked(tmp_path):
    dog = wd.Watchdog(WatchdogConfig(heartbeat_s=0.05), RunDir(tmp_path), 1, 2, on_hang=lambda r: None)
    try:
        time.sleep(0.15)
        assert not RunDir(tmp_path).heartbeats.exists()  # a refused start writes nothing
        dog.start_beating()
        dog.phase("step", 4)
        time.sleep(0.15)
        beat_now = wd.read_beats(RunDir(tmp_path), 2)[1]
        assert (beat_now["state"], beat_now["step"], beat_now["phase"], beat_now["rank"]) == ("running", 4, "step", 1)
        assert "test_watchdog_rules.py" in beat_now["where"] and not beat_now["waiting"]  # the main thread, here
    finally:
        dog.close()
    assert wd.read_beats(RunDir(tmp_path), 2)[1]["state"] == "ended"


def write_beat(run: RunDir, rank: int, **fields) -> None:
    run.heartbeat(rank).parent.mkdir(parents=True, exist_ok=True)
    run.heartbeat(rank).write_text(json.dumps(beat(rank, **fields)))


def test_on_a_hang_a_rank_reads_the_heartbeats_below_it_only_up_to_a_hung_one(tmp_path, monkeypatch):
    """At scale every rank must not read every heartbeat: rank 63 waits for rank 0 to go stale (stopped), finds
    rank 1 hung (it will report, or defer lower) and reads nothing above it."""
    run, world = RunDir(tmp_path), 64
    dog = wd.Watchdog(WatchdogConfig(enabled=False, heartbeat_s=0.05), run, 63, world, on_hang=lambda r: None)
    write_beat(run, 0, state="running")
    write_beat(run, 1, state="hung")
    for rank in range(2, world):
        write_beat(run, rank, state="running")
    read = []
    monkeypatch.setattr(wd, "_read", lambda path, real=wd._read: read.append(path.name) or real(path))
    watch = wd._Staleness(wd.STALE_BEATS * 0.05)
    assert dog._hung_below(watch) == 1
    assert set(read) == {"rank-00000.json", "rank-00001.json"} and read.count("rank-00001.json") == 1, read
    assert watch.update(wd.read_beats(run, world), me=63) == [0]  # the reporter's wait knows rank 0 stopped


@pytest.mark.parametrize("below, reporter", [({}, None), ({0: "ended", 1: "ended"}, None), ({0: "ended", 1: "hung"}, 1)])
def test_the_lowest_rank_still_beating_reports(tmp_path, below, reporter):
    run = RunDir(tmp_path)
    dog = wd.Watchdog(WatchdogConfig(enabled=False, heartbeat_s=0.05), run, len(below), 3, on_hang=lambda r: None)
    for rank, state in below.items():
        write_beat(run, rank, state=state)
    assert dog._hung_below(wd._Staleness(wd.STALE_BEATS * 0.05)) == reporter


def test_a_broken_collective_joins_this_launch_s_hang_only(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    dog = watchdog(tmp_path)
    dog.beating = True
    joined = []
    monkeypatch.setattr(dog, "_end_hung", joined.append)
    run.hang.mkdir()
    run.hang_began.write_text(json.dumps({"rank": 1, "time": time.time() - 3600}))  # an earlier launch's hang
    dog.join_hang()
    assert joined == []
    run.hang_began.write_text(json.dumps({"rank": 1, "time": time.time()}))
    dog.join_hang()
    assert joined and "a peer ended for a hang" in joined[0]


def test_while_rank_0_still_runs_a_hung_rank_reads_its_heartbeat_alone(tmp_path, monkeypatch):
    run, world = RunDir(tmp_path), 64
    dog = wd.Watchdog(WatchdogConfig(enabled=False, heartbeat_s=0.05), run, 63, world, on_hang=lambda r: None)
    for rank in range(1, world):
        write_beat(run, rank, state="running")
    done = threading.Event()

    def rank_0_beats():
        while not done.is_set():
            write_beat(run, 0, state="running")
            time.sleep(0.01)

    beater = threading.Thread(target=rank_0_beats)
    beater.start()
    read = []
    monkeypatch.setattr(wd, "_read", lambda path, real=wd._read: read.append(path.name) or real(path))
    try:
        assert dog._hung_below(wd._Staleness(wd.STALE_BEATS * 0.05)) is None  # the wait ended: rank 63 reports
    finally:
        done.set()
        beater.join()
    assert set(read) == {"rank-00000.json"}, sorted(set(read))


# A process that enters step 1 with a 1 s limit, says so, and leaves the step soon after it is continued: well
# within the limit, if the 3 s it was stopped do not count.
STOPPED = """
import sys, time
from clustertrain.config.schema import WatchdogConfig
from clustertrain.distributed.watchdog import Watchdog
from clustertrain.run_dir import RunDir
dog = Watchdog(WatchdogConfig(heartbeat_s=0.2, step_timeout_s=1), RunDir(sys.argv[1]), 0, 1, on_hang=print)
dog.phase("step", 1)
print("in step 1", flush=True)
sys.stdin.readline()  # the test stops this process, continues it, then writes a line
time.sleep(0.3)
dog.close()
"""


def test_the_time_a_process_was_stopped_does_not_count_against_its_phase(tmp_path):
    """Ctrl-Z, `scontrol suspend`: the watchdog thread wakes late with the process idle; the process ran about
    0.6 s in its phase, not the 3 s it was stopped."""
    proc = subprocess.Popen([sys.executable, "-c", STOPPED, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "in step 1\n"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(3)
    os.kill(proc.pid, signal.SIGCONT)
    stdout, stderr = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0, stdout + stderr[-2000:]


def test_only_a_late_wake_up_of_an_idle_process_is_a_stop(tmp_path):
    dog = watchdog(tmp_path)
    dog._count_stop(late_s=1.0, cpu_s=0.0)  # a late wake-up: the machine is busy
    dog._count_stop(late_s=30.0, cpu_s=40.0)  # kept from the GIL by a busy main thread: the process ran
    assert dog._stopped_s == 0
    dog._count_stop(late_s=300.0, cpu_s=0.5)
    assert dog._stopped_s == 300
