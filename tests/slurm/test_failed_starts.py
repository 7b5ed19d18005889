"""Real Slurm: a job whose run fails before its first step (CLUSTERTRAIN_FAULT="start@...") is retried under the same
job id, off the node `clustertrain doctor` named, and finishes; start failures past slurm.max_start_retries give up."""

from __future__ import annotations

import sys

import pytest
from slurmjobs import log, require_slurm, submit, wait_until_done

from clustertrain.launch.jobs import read_chain
from clustertrain.run_dir import RunDir

pytestmark = [pytest.mark.dist, pytest.mark.slurm]


@pytest.fixture(autouse=True)
def _slurm():
    require_slurm()


def doctor_naming_its_node(run_dir):
    """slurm.python: a Python that, as rank 0 of restart 0, first writes doctor.json naming its node bad, as the
    doctor's job step would."""
    python = run_dir.parent / f"{run_dir.name}-python"
    first_rank0 = '[ "$3" = train ] && [ "$SLURM_PROCID" = 0 ] && [ "${SLURM_RESTART_COUNT:-0}" = 0 ]'
    report = '{\\"bad_hosts\\": [\\"$SLURMD_NODENAME\\"]}'
    python.write_text(f'#!/bin/bash\nif {first_rank0}; then echo "{report}" > {run_dir}/doctor.json; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def test_a_failed_start_is_retried_off_the_named_node_and_finishes(tmp_path):
    run_dir = tmp_path / "run"
    job = submit(run_dir, "train.steps=10", f"slurm.python={doctor_naming_its_node(run_dir)}",
                 env={"CLUSTERTRAIN_FAULT": "start@0:0=1"})
    assert wait_until_done(run_dir, timeout=240) == ["retried", "finished"]
    starts = [e for e in read_chain(RunDir(run_dir)) if e["event"] == "started"]
    assert [(e["job_id"], e["restart"]) for e in starts] == [(job, 0), (job, 1)]  # requeued: the same job id
    first, second = starts[0]["nodes"], starts[1]["nodes"]
    assert first != second, (first, second)  # node1 and node2 are the only nodes
    text = log(run_dir)
    assert "rank 0 fails its start (restart 0) with exit code 1" in text
    assert "the run failed before its first step (exit code 1" in text
    assert "retry 1 of at most 2 (slurm.max_start_retries)" in text
    assert f"excluding {first} (named by clustertrain doctor) from the next start" in text
    assert read_chain(RunDir(run_dir))[2]["excluded"] == first


def test_start_failures_past_max_start_retries_give_up(tmp_path):
    submit(tmp_path, "train.steps=10", "slurm.max_start_retries=1", env={"CLUSTERTRAIN_FAULT": "start@1=1"})
    assert wait_until_done(tmp_path, timeout=240) == ["retried", "gave-up"]
    text = log(tmp_path)
    assert "not retried: 1 failed start(s) in a row reached slurm.max_start_retries = 1" in text
    assert "excluding" not in text  # no doctor named a node
