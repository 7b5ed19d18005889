"""Checkpoints under real processes: preemption signals, retention, async saves, a disk that fills up."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import time

import pytest
import torch
from helpers import children, final_weights, losses, start, train, wait_for_saves, wait_for_step

from clustertrain.checkpoint.manager import SAVE_FAILED_EXIT_CODE
from clustertrain.train.status import REQUEUE_EXIT_CODE, read_status

pytestmark = pytest.mark.dist


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


@pytest.mark.parametrize(("policy", "stop_after", "lost"), [
    ("warn", None, "3-8"),  # steps 4 and 6 fail with a warning, then the final save at step 8
    ("warn", 2, "3-4"),  # the final save at train.stop_after_steps
    ("stop", None, None),  # the first failure ends the run
])
def test_a_failed_write_keeps_the_previous_checkpoint_and_a_lost_final_save_fails_the_run(tmp_path, policy,
                                                                                           stop_after, lost):
    train(tmp_path, "train.steps=8", "checkpoint.every=2", "train.stop_after_steps=2")
    proc = start(tmp_path, "train.steps=8", "checkpoint.every=2", f"checkpoint.on_error={policy}",
                 *([f"train.stop_after_steps={stop_after}"] if stop_after else []), nproc=1, preexec_fn=small_files)
    stdout, stderr = proc.communicate(timeout=180)
    assert "checkpoint of step 4 failed" in stdout + stderr
    assert "step-0000002 is intact" in stdout + stderr
    assert proc.returncode == SAVE_FAILED_EXIT_CODE, stderr[-2000:]
    assert "Traceback" not in stderr
    status = read_status(tmp_path)
    assert status["state"] == "failed"
    if lost:  # a lost final save is a failure, whatever checkpoint.on_error says
        assert f"it was this run's last save, so steps {lost} are lost" in stderr
        assert f"steps {lost} are lost" in status["error"]
    if policy == "warn" and not stop_after:
        assert "checkpoint of step 6 failed" in stdout and "training goes on" in stdout
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step-0000002"]
    train(tmp_path, "train.steps=8", "checkpoint.every=2")  # the kept checkpoint resumes
    assert (tmp_path / "checkpoints" / "step-0000008").is_dir()


def test_sigkill_at_random_moments_still_ends_bit_identical(tmp_path):
    steps = 60  # long enough that ten kills, each after a few steps of progress, never reach the end
    overrides = [f"train.steps={steps}", "checkpoint.every=2", "checkpoint.keep_last=2"]
    reference = tmp_path / "reference"
    train(reference, *overrides, nproc=2)
    chaos, rng = tmp_path / "chaos", random.Random(7)
    kills, during_save = 0, 0
    while kills < 10:
        proc = start(chaos, *overrides)
        if kills % 2:  # inside a save: the second one this launch starts, so each launch progresses
            during_save += wait_for_saves(chaos, proc, count=2)
        else:  # anywhere: a few steps into this launch, plus a random fraction of a step
            wait_for_new_steps(chaos, proc, rng.randint(1, 3))
            time.sleep(rng.uniform(0, 0.3))
        if proc.poll() is not None:
            raise AssertionError(f"launch {kills + 1} ended (exit {proc.returncode}) before it could be killed: "
                                 f"{proc.communicate()[1][-3000:]}")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        for folder in (chaos / "checkpoints").glob("step-*"):  # visible means complete
            assert (folder / "train_state.json").exists(), folder
    train(chaos, *overrides, nproc=2)
    assert during_save >= 3, f"only {during_save} kills landed inside a save"
    ours, theirs = final_weights(chaos, steps), final_weights(reference, steps)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def wait_for_new_steps(run_dir, proc, count, timeout=120):
    """Poll until this launch has logged `count` more training steps."""
    path = run_dir / "metrics.jsonl"
    lines = lambda: path.read_text().count('"loss"') if path.exists() else 0  # noqa: E731
    baseline, deadline = lines(), time.monotonic() + timeout
    while lines() < baseline + count and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_resume_onto_other_rank_counts_and_strategies(tmp_path):
    common = ["train.steps=12", "checkpoint.every=4"]
    reference = tmp_path / "reference"
    train(reference, *common, "parallel.strategy=zero3", nproc=2)
    moved = tmp_path / "moved"
    train(moved, *common, "parallel.strategy=zero3", "train.stop_after_steps=4", nproc=2)
    train(moved, *common, "parallel.strategy=ddp", "train.stop_after_steps=4")  # one rank
    step8 = moved / "checkpoints" / "step-0000008"
    train(moved, *common, "parallel.strategy=hybrid_zero2", "parallel.hybrid_shard_size=1", nproc=2,
          extra_args=("--resume", str(step8)))
    ours, theirs = losses(moved), losses(reference)
    for step in (5, 9, 12):
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), step


def test_walltime_saves_before_the_limit(tmp_path):
    proc = start(tmp_path, "train.steps=100000", "checkpoint.every=0", "train.walltime=12", "train.walltime_margin=0",
                 nproc=1)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == REQUEUE_EXIT_CODE, stderr[-2000:]
    assert "stopped by walltime" in stderr
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 1
