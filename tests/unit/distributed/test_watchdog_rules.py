"""The watchdog's rules in-process: phase timeouts, who is stuck from the heartbeats, and staleness by change."""

from __future__ import annotations

import time

import pytest

from clustertrain.config.schema import WatchdogConfig
from clustertrain.distributed import watchdog as wd
from clustertrain.run_dir import RunDir


def beat(rank: int, step: int = 7, waiting: bool = True, **extra) -> dict:
    return {"rank": rank, "host": f"node{rank}", "pid": 100 + rank, "state": "hung", "step": step, "phase": "step",
            "time": time.time(), "where": "a.py:1 in f", "waiting": waiting, **extra}


@pytest.mark.parametrize("beats, stale, stuck, words", [
    ({0: beat(0), 1: beat(1)}, [1], [1], "rank 1 (host node1, pid 101) stopped beating"),
    ({0: beat(0)}, [], [1], "rank 1 never beat"),
    ({0: beat(0), 1: beat(1, waiting=False), 2: beat(2)}, [], [1], "while ranks 0, 2 wait in a collective"),
    ({0: beat(0, step=8), 1: beat(1, step=7), 2: beat(2, step=8)}, [], [1], "rank 1 is behind, in step 7"),
    ({0: beat(0), 1: beat(1)}, [], [], "every rank waits in a collective"),
])
def test_the_stuck_rank_is_named_from_the_heartbeats(beats, stale, stuck, words):
    world = 3 if 2 in beats else 2
    report = wd.diagnose(beats, stale, world, 0, "5 s in step 7 (limit 4 s)")
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
