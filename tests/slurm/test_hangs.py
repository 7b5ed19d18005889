"""Real Slurm: a job whose rank hangs (stopped with SIGSTOP) is ended by the watchdog, requeued, and finishes."""

from __future__ import annotations

import json
import os
import signal

import pytest
from slurmjobs import last_step, log, require_slurm, submit, wait_for, wait_until_done

from clustertrain.launch.jobs import read_chain
from clustertrain.run_dir import RunDir
from clustertrain.train.status import read_status

pytestmark = [pytest.mark.dist, pytest.mark.slurm]


def test_a_hung_rank_ends_the_job_which_is_requeued_and_finishes(tmp_path):
    require_slurm()
    submit(tmp_path, "train.steps=600", "checkpoint.every=50", "watchdog.heartbeat_s=0.5",
           "watchdog.step_timeout_s=5", "watchdog.save_timeout_s=5")
    wait_for(lambda: last_step(tmp_path) >= 60 and RunDir(tmp_path).heartbeat(1).exists(), tmp_path, "step 60")
    os.kill(json.loads(RunDir(tmp_path).heartbeat(1).read_text())["pid"], signal.SIGSTOP)  # one host: its pid is ours
    assert wait_until_done(tmp_path) == ["requeued", "finished"]
    text = log(tmp_path)
    assert "hang: rank 1" in text and "stopped beating" in text and "excluding node" in text, text[-3000:]
    ended = [e for e in read_chain(RunDir(tmp_path)) if e["event"] == "ended"]
    assert ended[0]["exit_code"] != 0 and read_status(RunDir(tmp_path))["state"] == "finished"
