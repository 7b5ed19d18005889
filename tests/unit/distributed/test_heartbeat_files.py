"""The watchdog's heartbeat files as their readers meet them: a peer's watchdog and `clustertrain status` read
them while their rank rewrites them, and must never find one empty or cut short."""

from __future__ import annotations

import json
import threading
import time

from clustertrain.config.schema import WatchdogConfig
from clustertrain.distributed import watchdog as wd
from clustertrain.run_dir import RunDir

BEATS = 1000  # the writer's; a beat written in place is found empty by most reads that race it


def test_a_heartbeat_read_while_its_rank_rewrites_it_is_always_whole(tmp_path):
    run = RunDir(tmp_path)
    dog = wd.Watchdog(WatchdogConfig(enabled=False), run, 0, 1, on_hang=lambda report: None)
    dog.beating = True
    dog._beat("running")  # the rank's first beat: from here on the file exists
    done = threading.Event()

    def beat_on() -> None:  # the real writer, as the watchdog thread calls it every period, here without a pause
        try:
            for step in range(BEATS):
                dog.phase("step", step)
                dog._beat("running")
        finally:
            done.set()

    writer = threading.Thread(target=beat_on)
    writer.start()
    reads, torn = 0, []
    deadline = time.monotonic() + 60
    try:
        while not done.is_set() and time.monotonic() < deadline:
            reads += 1
            beat = wd.read_beats(run, 1).get(0)  # the peers' reader: {} for a file it cannot parse
            if not beat or beat.get("rank") != 0:
                torn.append(run.heartbeat(0).read_bytes()[:80])
    finally:
        done.set()
        writer.join()
    assert not torn, f"{len(torn)} of {reads} reads found a heartbeat empty or cut short, e.g. {torn[:3]}"
    assert reads > 100, f"only {reads} reads raced the writer"
    assert json.loads(run.heartbeat(0).read_text())["step"] == BEATS - 1
