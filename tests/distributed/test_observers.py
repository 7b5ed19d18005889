"""A feature joins a run as an observer, from outside, with no change to the trainer: a test observer handed to
`Trainer(config, observers=[...])` on two real ranks records every fixed point of a run of 2 steps and of its
resume to step 4."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import TINY, run_ranks

pytestmark = pytest.mark.dist
KEYS = ("loss", "eval_loss", "load_mem_gb", "checkpoint_blocking_s")  # what the recorder notes of each record

RUN = ["parallel.strategy=zero3", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2",
       "train.sample_tokens=0"]


def _rank(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from clustertrain.config.load import load_config
    from clustertrain.train.observers import Observer
    from clustertrain.train.trainer import Trainer

    class Recorder(Observer):
        def __init__(self):
            self.points: list[list] = []

        def on_start(self, run):
            self.points.append(["start", run.step, len(run.model.runner.parts)])

        def on_step_start(self, step):
            self.points.append(["step_start", step])

        def on_step_end(self, step, result):
            self.points.append(["step_end", step, bool(result.grad_norm.isfinite())])

        def on_log(self, step, record):
            self.points.append(["log", step, sorted(k for k in record if k in KEYS)])

        def on_eval(self, step):
            self.points.append(["eval", step])

        def on_save(self, step):
            self.points.append(["save", step])

        def on_end(self, outcome):
            self.points.append(["end", outcome])

    recorder = Recorder()
    start = len(list(Path(out).glob(f"rank-{rank}-start-*.json")))
    Trainer(load_config(None, [*TINY, *overrides]), observers=[recorder]).run()
    Path(out, f"rank-{rank}-start-{start}.json").write_text(json.dumps(recorder.points))


def _expected(first: int, last: int) -> list[list]:
    """The points of a start that trains steps `first`..`last`: an evaluation and a save every 2 steps, each save
    followed by the time it blocked the loop."""
    points: list[list] = [["start", first - 1, 1], ["log", first - 1, ["load_mem_gb"]]]
    for step in range(first, last + 1):
        points += [["step_start", step], ["log", step, ["loss"]], ["step_end", step, True]]
        if step % 2 == 0:
            # the standard observers come first: the held-out loss is logged before this observer's on_eval
            points += [["log", step, ["eval_loss"]], ["eval", step], ["save", step], ["log", step, [KEYS[-1]]]]
    return points + [["save", last], ["end", "finished"]]  # the run's last save, waited for at its end


def test_an_observer_from_outside_sees_every_point_of_a_run_and_its_resume(tmp_path):
    run_ranks(_rank, tmp_path, [*RUN, "train.steps=2"])
    run_ranks(_rank, tmp_path, [*RUN, "train.steps=4"])  # resumes from step 2
    for rank in range(2):
        first, resumed = (json.loads((tmp_path / f"rank-{rank}-start-{i}.json").read_text()) for i in range(2))
        assert first == _expected(1, 2), f"rank {rank}, first start"
        assert resumed == _expected(3, 4), f"rank {rank}, resumed start"
