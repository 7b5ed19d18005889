"""Real Slurm: a 2-rank job preempted by a signal or by its time limit checkpoints, is requeued, resumes,
and ends with the same weights as an uninterrupted run."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import final_weights, train
from slurmjobs import LONG, last_step, log, outcomes, require_slurm, scancel, submit, wait_for, wait_until_done

from clustertrain.launch.jobs import read_chain
from clustertrain.run_dir import RunDir

pytestmark = [pytest.mark.dist, pytest.mark.slurm]
STEPS = 1200  # about 25 s of training on 2 idle cores: still training when the USR1 sent at step 100 arrives


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
    starts = [e for e in read_chain(RunDir(tmp_path)) if e["event"] == "started"]
    assert [(e["job_id"], e["restart"]) for e in starts] == [(job, 0), (job, 1)]  # the same job id, requeued
    assert_same_weights(tmp_path, uninterrupted)


def test_time_limit_warning_saves_requeues_and_resumes(tmp_path):
    # --time=2 with --signal=B:USR1@60: Slurm warns the batch shell 30-60 s in, and it passes USR1 on to the ranks.
    # The run is longer than its job in wall time on any machine (its steps never run out), so the warning finds
    # it training; its one requeue (slurm.max_restarts=1) resumes, and our USR1 then ends the chain (gave-up)
    # instead of the next time limit. (The weights after a requeue are compared in the test above.)
    require_slurm()
    job = submit(tmp_path, "train.steps=100000000", "slurm.time=2", "slurm.max_restarts=1")
    wait_for(lambda: outcomes(tmp_path)[:1] == ["requeued"], tmp_path, "Slurm's time-limit warning", timeout=600)
    stopped = int(re.search(r"stopped by SIGUSR1 at step (\d+) after saving", log(tmp_path))[1])
    assert (tmp_path / "checkpoints" / f"step-{stopped:07d}").is_dir()
    resumed = f"resuming from {tmp_path}/checkpoints/step-{stopped:07d} at step {stopped}"
    wait_for(lambda: resumed in log(tmp_path) and last_step(tmp_path) > stopped, tmp_path, "the resumed run")
    scancel("--signal=USR1", job)
    assert wait_until_done(tmp_path) == ["requeued", "gave-up"]
    starts = [(e["job_id"], e["restart"]) for e in read_chain(RunDir(tmp_path)) if e["event"] == "started"]
    assert starts == [(job, 0), (job, 1)]
