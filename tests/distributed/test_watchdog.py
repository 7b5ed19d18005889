"""The hang watchdog with 2 real gloo ranks: a rank late inside a collective, a stopped rank and a killed rank are
each named; a hung run exits 76 with every live rank's stacks, and its resume ends like an uninterrupted run; a job
stopped as a whole past its step limit and continued trains on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import check_ending, descendants, final_weights, losses, start, train, wait_for_step
from torch.testing import assert_close

from clustertrain.distributed.faults import FAULT_ENV
from clustertrain.errors import ExitCode
from clustertrain.run_dir import RunDir
from clustertrain.train.status import read_status

pytestmark = pytest.mark.dist

# Beats every 0.5 s; a step (about 20 ms here) past 4 s is hung. The collective timeout stays 10 minutes: the
# watchdog, not gloo, must notice.
WATCH = ("watchdog.heartbeat_s=0.5", "watchdog.step_timeout_s=4")
STEPS = ("train.steps=12", "checkpoint.every=4", "model.config.attention_dropout=0.1")


def heartbeat(run_dir, rank: int) -> dict:
    return json.loads(RunDir(run_dir).heartbeat(rank).read_text())


def test_a_rank_late_inside_a_collective_is_named_and_the_resume_ends_like_an_uninterrupted_run(tmp_path):
    hung, whole = tmp_path / "hung", tmp_path / "whole"
    began = time.monotonic()
    result = train(hung, *WATCH, *STEPS, nproc=2, env={FAULT_ENV: "collective@1:7=600"}, expect=ExitCode.HUNG)
    assert time.monotonic() - began < 90  # not the 600 s sleep, not gloo's 10-minute timeout
    status = read_status(RunDir(hung))
    assert (status["stuck_ranks"], status["phase"], status["step"]) == ([1], "step", 7), status
    line = [x for x in result.stderr.splitlines() if x.startswith("error: hang:")]
    assert len(line) == 1 and "rank 1" in line[0] and "faults.py" in line[0] and "waits in a collective" in line[0], \
        result.stderr
    run = RunDir(hung)
    assert json.loads(run.hang_report.read_text())["stacks"] == ["rank-00000.txt", "rank-00001.txt"]
    assert "in delay" in run.hang_stacks(1).read_text().split("\nThread ")[1]  # the main thread comes first
    assert "all_reduce" in run.hang_stacks(0).read_text()
    assert heartbeat(hung, 1)["state"] == "hung" and not run.lock.exists()

    train(hung, *WATCH, *STEPS, nproc=2)  # resumes from step 4
    assert min(s for s in losses(hung) if s > 4) == 5
    train(whole, *WATCH, *STEPS, nproc=2)
    assert_close(final_weights(hung, 12), final_weights(whole, 12), rtol=0, atol=0)
    assert heartbeat(hung, 0)["state"] == "ended"


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_rank_is_named_by_its_missing_heartbeat(tmp_path, sig):
    proc = start(tmp_path, *WATCH, "train.steps=100000", "checkpoint.every=0")
    wait_for_step(tmp_path, 40, proc)  # past a few beats
    beat = heartbeat(tmp_path, 1)
    while heartbeat(tmp_path, 1)["time"] == beat["time"]:  # a fresh beat, then steps past it: the beat lags
        time.sleep(0.01)
    wait_for_step(tmp_path, heartbeat(tmp_path, 1)["step"] + 3, proc)
    victim = beat["pid"]
    os.kill(victim, sig)
    began = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    status = read_status(RunDir(tmp_path))
    if sig == signal.SIGSTOP:
        assert proc.returncode == ExitCode.HUNG, stderr
        assert time.monotonic() - began < 4 + 10, stderr  # the step timeout, then 2.5 beats of silence
        assert status["state"] == "hung" and status["stuck_ranks"] == [1], status
        # the step it stopped in is the one rank 0 waits in (every step's gradients need both ranks), not the
        # step of its last heartbeat, a few steps before
        last_beat = heartbeat(tmp_path, 1)["step"]
        waited_in = json.loads(RunDir(tmp_path).hang_report.read_text())["step"]
        assert last_beat < waited_in, (last_beat, waited_in)
        assert (f"rank 1 (host {os.uname().nodename}, pid {victim}) stopped beating" in status["error"]
                and f"in step {waited_in}, where the others wait for it, after its last heartbeat from step {last_beat}"
                in status["error"]), status
        assert "collective" not in status["error"].split("stopped beating")[1].split(";")[0], status
        assert RunDir(tmp_path).hang_stacks(0).exists()
    else:  # rank 0 learns of it from its broken connection, and names it from the heartbeat, not "a peer"
        assert status["state"] == "failed", status
        assert f"rank 1 (host {os.uname().nodename}, pid {victim}) died without a word" in status["error"], status


def test_a_job_suspended_as_a_whole_past_its_step_limit_trains_on_to_the_same_losses(tmp_path):
    """Ctrl-Z, `scontrol suspend`: every process of the job stopped for longer than a step may take, then continued.
    The time no process ran is no hang: the run ends as an unsuspended one, loss for loss."""
    steps = ("train.steps=60", "checkpoint.every=0")
    train(tmp_path / "whole", *WATCH, *steps, nproc=2)
    proc = start(tmp_path / "suspended", *WATCH, *steps)
    wait_for_step(tmp_path / "suspended", 5, proc)
    job = descendants(proc.pid)  # the launcher and its ranks
    assert len(job) == 3, job
    for pid in job:
        os.kill(pid, signal.SIGSTOP)
    stopped_at = max(losses(tmp_path / "suspended"))
    time.sleep(4 + 2)  # past the 4 s step limit
    for pid in job:
        os.kill(pid, signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=120)
    check_ending(tmp_path / "suspended", subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert stopped_at < 60 and not RunDir(tmp_path / "suspended").hang.exists()
    assert losses(tmp_path / "suspended") == losses(tmp_path / "whole")
