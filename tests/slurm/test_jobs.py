"""Real Slurm: torchrun per node, two nodes, the batch shell's signal path, follow-up jobs, and what is
never requeued (a real error, a crash loop)."""

from __future__ import annotations

import subprocess

import pytest
from helpers import losses, run_cli, train
from slurmjobs import (LONG, last_step, log, outcomes, require_slurm, scancel, submit, wait_for,
                       wait_until_done)

from clustertrain.launch.jobs import read_chain
from clustertrain.run_dir import RunDir

pytestmark = [pytest.mark.dist, pytest.mark.slurm]


@pytest.fixture(autouse=True)
def _slurm():
    require_slurm()


def test_torchrun_per_node_passes_the_batch_warning_to_its_ranks(tmp_path):
    steps = 400
    job = submit(tmp_path, f"train.steps={steps}", "slurm.launcher=torchrun", "metrics.log_every=10")
    wait_for(lambda: last_step(tmp_path) >= 50, tmp_path, "step 50")
    scancel("--batch", "--signal=USR1", job)  # the batch shell only, as --signal=B:USR1 does
    assert wait_until_done(tmp_path) == ["requeued", "finished"]
    text = log(tmp_path)
    assert "2 rank(s) on 1 node(s) via torchrun" in text and "stopped by SIGUSR1" in text
    train(tmp_path / "uninterrupted", *LONG, f"train.steps={steps}", "metrics.log_every=10", nproc=2)
    assert losses(tmp_path)[steps] == losses(tmp_path / "uninterrupted")[steps]


def test_two_node_job_runs_one_rank_per_node(tmp_path):
    submit(tmp_path, "train.steps=20", "slurm.nodes=2", "slurm.tasks_per_node=1")
    assert wait_until_done(tmp_path) == ["finished"]
    assert "2 rank(s) on 2 node(s) via slurm" in log(tmp_path)
    assert read_chain(RunDir(tmp_path))[1]["nodes"] == "node[1-2]"


def test_a_real_error_is_not_requeued_and_odd_names_are_quoted(tmp_path):
    name = "it's a $(touch pwned) job"
    job = submit(tmp_path, "data.sources=[{path: /no/such/file.jsonl}]", f"slurm.job_name={name}")
    assert wait_until_done(tmp_path) == ["failed"]

    def shown() -> str:
        return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout

    # The chain records "failed" from inside the job; Slurm marks the job FAILED a moment later.
    wait_for(lambda: "JobState=RUNNING" not in shown() and "JobState=COMPLETING" not in shown(), tmp_path,
             "Slurm to end the job", timeout=60)
    assert f"JobName={name}" in shown() and "Restarts=0" in shown() and "JobState=FAILED" in shown()
    assert "/no/such/file.jsonl" in log(tmp_path) and "not requeued" in log(tmp_path)
    assert not list(tmp_path.rglob("pwned"))


def test_max_restarts_stops_requeueing(tmp_path):
    job = submit(tmp_path, "train.steps=4000", "slurm.max_restarts=0")
    wait_for(lambda: last_step(tmp_path) >= 50, tmp_path, "step 50")
    scancel("--signal=USR1", job)
    assert wait_until_done(tmp_path) == ["gave-up"]
    assert "slurm.max_restarts = 0" in log(tmp_path)


def test_dependency_mode_submits_a_follow_up_job_and_status_shows_the_chain(tmp_path):
    first = submit(tmp_path, "train.steps=600", "slurm.requeue=dependency")
    wait_for(lambda: last_step(tmp_path) >= 50, tmp_path, "step 50")
    scancel("--signal=USR1", first)
    assert wait_until_done(tmp_path) == ["resubmitted", "finished"]
    chain = read_chain(RunDir(tmp_path))
    follow_up = chain[2]["next_job"]
    assert follow_up != first and [e["job_id"] for e in chain if e["event"] == "started"] == [first, follow_up]
    status = run_cli("slurm", "status", str(tmp_path))
    assert status.returncode == 0, status.stderr
    for text in (first, follow_up, "resubmitted", "finished at step 600/600", "step-0000600"):
        assert text in status.stdout, status.stdout
    assert outcomes(tmp_path)[-1] == "finished"
