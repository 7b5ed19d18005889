"""Real Slurm: a 2-rank job preempted by a signal or by its time limit checkpoints, is requeued, resumes,
and ends with the same weights as an uninterrupted run."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import final_weights, train
from slurmjobs import LONG, log, require_slurm, scancel, submit, wait_for, wait_until_done, last_step

from clustertrain.launch.jobs import read_chain

pytestmark = [pytest.mark.dist, pytest.mark.slurm]
STEPS = 3000  # about 60 s of training on 2 idle cores: longer than the 30-60 s warning of a 2-minute job


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    require_slurm()
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(run_dir, *LONG, f"train.steps={STEPS}", nproc=2)
    return final_weights(run_dir, STEPS)


def assert_same_weights(run_dir, reference):
    ours = final_weights(run_dir, STEPS)
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.equal(ours[name], reference[name]), name


def test_usr1_checkpoints_requeues_and_finishes_like_an_uninterrupted_run(tmp_path, uninterrupted):
    job = submit(tmp_path, f"train.steps={STEPS}")
    wait_for(lambda: last_step(tmp_path) >= 100, tmp_path, "step 100")
    scancel("--signal=USR1", job)  # to every rank of the step, as Slurm's preemption signal would be
    assert wait_until_done(tmp_path) == ["requeued", "finished"]
    text = log(tmp_path)
    stopped = int(re.search(r"stopped by SIGUSR1 at step (\d+) after saving", text)[1])
    assert f"resuming from {tmp_path}/checkpoints/step-{stopped:07d} at step {stopped}" in text
    starts = [e for e in read_chain(tmp_path) if e["event"] == "started"]
    assert [(e["job_id"], e["restart"]) for e in starts] == [(job, 0), (job, 1)]  # the same job id, requeued
    assert_same_weights(tmp_path, uninterrupted)


def test_time_limit_warning_requeues_until_done(tmp_path):
    # --time=2 with --signal=B:USR1@60: Slurm warns the batch shell 30-60 s in, and passes USR1 on to the ranks.
    # Twice the steps of the run above, so that even a fast machine is still training when the warning comes.
    # (The weights after a requeue are compared with an uninterrupted run's in the test above.)
    steps = 2 * STEPS
    require_slurm()
    submit(tmp_path, f"train.steps={steps}", "slurm.time=2")
    found = wait_until_done(tmp_path, timeout=900)
    assert found[-1] == "finished" and "requeued" in found, found
    assert "stopped by SIGUSR1" in log(tmp_path)
    assert (tmp_path / "checkpoints" / f"step-{steps:07d}").is_dir()
