"""Checkpoints under real processes: preemption signals, retention, async saves, a disk that fills up."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
from helpers import TINY, losses, train

from clustertrain.checkpoint.manager import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.dist


def start(run_dir, *overrides, nproc=2, preexec_fn=None):
    args = [f"--set={o}" for o in (*TINY, f"train.run_dir={run_dir}", *overrides)]
    return subprocess.Popen(
        [sys.executable, "-m", "clustertrain", "train", "--nproc", str(nproc), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=preexec_fn,
    )


def wait_for_step(run_dir, step, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        if max(losses(run_dir), default=0) >= step if (run_dir / "metrics.jsonl").exists() else False:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_to_one_rank_checkpoints_every_rank_and_asks_for_requeue(tmp_path, signum):
    proc = start(tmp_path, "train.steps=500", "checkpoint.every=0")
    wait_for_step(tmp_path, 3, proc)
    os.kill(children(proc.pid)[-1], signum)  # only the last rank hears it, as when Slurm signals one task
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE_EXIT_CODE, stderr[-2000:]
    assert f"stopped by {signal.Signals(signum).name} at step" in stderr
    saved = sorted((tmp_path / "checkpoints").glob("step-*"))
    assert len(saved) == 1
    state = json.loads((saved[0] / "train_state.json").read_text())
    assert state["step"] == max(losses(tmp_path)) < 500
    assert (saved[0] / "rng-0.json").exists() and (saved[0] / "rng-1.json").exists()


def test_retention_keeps_the_last_the_multiples_and_the_final(tmp_path):
    train(tmp_path, "train.steps=12", "checkpoint.every=2", "checkpoint.keep_last=2", "checkpoint.keep_every=4")
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").glob("step-*"))
    assert kept == [4, 8, 10, 12]


def test_async_saves_train_identically_and_log_their_blocking_time(tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    train(sync_dir, "train.steps=8", "checkpoint.every=2", nproc=2)
    train(async_dir, "train.steps=8", "checkpoint.every=2", "checkpoint.async=true", nproc=2)
    assert losses(async_dir) == losses(sync_dir)
    records = [json.loads(line) for line in (async_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("checkpoint_blocking_s") is not None for r in records)
    assert (async_dir / "checkpoints" / "step-0000008").is_dir()
    resumed = tmp_path / "resumed"
    train(resumed, "train.steps=8", "checkpoint.every=2", "checkpoint.async=true", "train.stop_after_steps=4", nproc=2)
    train(resumed, "train.steps=8", "checkpoint.every=2", "checkpoint.async=true", nproc=2)
    assert losses(resumed)[8] == losses(sync_dir)[8]


def small_files():
    """A 300 kB file-size limit: the checkpoint shards no longer fit, as on a full quota."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))


@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, policy):
    train(tmp_path, "train.steps=8", "checkpoint.every=2", "train.stop_after_steps=2")
    proc = start(tmp_path, "train.steps=8", "checkpoint.every=2", f"checkpoint.on_error={policy}", nproc=1,
                 preexec_fn=small_files)
    stdout, stderr = proc.communicate(timeout=180)
    message = "checkpoint of step 4 failed"
    assert message in stdout + stderr
    assert "step-0000002 is intact" in stdout + stderr
    if policy == "stop":
        assert proc.returncode == 2 and "Traceback" not in stderr
    else:
        assert proc.returncode == 0, stderr[-2000:]
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step-0000002"]
    train(tmp_path, "train.steps=8", "checkpoint.every=2")  # the kept checkpoint resumes
    assert (tmp_path / "checkpoints" / "step-0000008").is_dir()
