"""Async checkpoints under two real ranks: a log step never waits for a write in flight, which is committed at
a later log step once done, and a checkpoint folder is only ever seen complete."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent import futures
from pathlib import Path

import pytest
from helpers import TINY, run_ranks

pytestmark = pytest.mark.dist

RELEASE_AT = 9  # the write of step 6 is held until its rank has logged this step
HOLD_S = 30  # ... or this long: a log step that waits for the write gives up here, and the test fails


def _rank(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    """Train as `clustertrain train` does, with this rank's shard writes held (a slow file system) and its log
    steps, commits and visible checkpoints recorded into `out/rank-<rank>.json`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from torch.distributed.checkpoint import FileSystemWriter

    from clustertrain.checkpoint import dcp as ckpt
    from clustertrain.checkpoint.manager import CheckpointManager
    from clustertrain.config.load import load_config
    from clustertrain.train.observers import Observer
    from clustertrain.train.trainer import Trainer

    record = {"held": [], "log_steps": [], "commits": [], "incomplete": []}
    logged, release, in_log_step = [0], threading.Event(), [False]
    write, commit_if_done, commit = FileSystemWriter.write_data, CheckpointManager.commit_if_done, ckpt.commit
    root = Path(overrides[0].split("=", 1)[1]) / "checkpoints"

    def held_write(self, plan, planner):  # in DCP's background thread
        start = time.monotonic()
        released = release.wait(HOLD_S)
        record["held"].append({"logged": logged[0], "released": released, "held_s": time.monotonic() - start})
        return write(self, plan, planner)

    class LogSteps(Observer):  # a log step's record, before the step commits what is done
        def on_start(self, run):
            self.run = run

        def on_log(self, step, values):
            if "loss" not in values:
                return
            logged[0] = step
            if step >= RELEASE_AT:
                release.set()
            pending = self.run.checkpoints._pending
            if step > RELEASE_AT and pending:  # let this rank's write end before this log step
                futures.wait([pending[0]], timeout=HOLD_S)
            record["incomplete"] += [p.name for p in root.glob("step-*") if not (p / "train_state.json").exists()
                                     or not (p / ".metadata").exists()]

    def timed_commit_if_done(self):
        pending, start, in_log_step[0] = self._pending is not None, time.monotonic(), True
        try:
            return commit_if_done(self)
        finally:
            in_log_step[0] = False
            record["log_steps"].append({"step": logged[0], "pending": pending, "s": time.monotonic() - start})

    def recorded_commit(root_, step, *args):
        record["commits"].append({"step": step, "logged": logged[0], "at_log_step": in_log_step[0]})
        return commit(root_, step, *args)

    FileSystemWriter.write_data = held_write
    CheckpointManager.commit_if_done = timed_commit_if_done
    ckpt.commit = recorded_commit
    Trainer(load_config(None, [*TINY, *overrides]), observers=[LogSteps()]).run()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(record))


def run_held(tmp_path: Path, overrides: list[str]) -> list[dict]:
    run_ranks(_rank, tmp_path, overrides)
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]


def test_async_commit_not_blocking_at_a_log_step_with_a_slowed_writer(tmp_path):
    records = run_held(tmp_path, ["train.steps=12", "checkpoint.every=6", "checkpoint.async=true"])
    for rank, record in enumerate(records):
        # step 6's write was held until step 9 was logged: the log steps 7 and 8 went on while it was in flight
        first = record["held"][0]
        assert first["released"] and first["logged"] >= RELEASE_AT, (rank, record["held"])
        in_flight = [c for c in record["log_steps"] if c["pending"] and c["step"] < RELEASE_AT]
        assert [c["step"] for c in in_flight] == [7, 8], (rank, record["log_steps"])
        assert max(c["s"] for c in in_flight) < 2.0, (rank, in_flight)
        # committed at the first log step after its write ended; the final save waited for its own write
        (six, twelve) = record["commits"]
        assert six == {"step": 6, "logged": RELEASE_AT + 1, "at_log_step": True}, (rank, six)
        assert twelve == {"step": 12, "logged": 12, "at_log_step": False}, (rank, twelve)
        assert record["incomplete"] == []
    assert records[0]["commits"] == records[1]["commits"]  # the ranks agreed on the step of each commit
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000006", "step-0000012"]
