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
from helpers import (SLOW_WRITE_ENV, alive, children, final_weights, grad_norms, losses, slow_checkpoint_writes, start,
                     train, wait_for_saves, wait_for_step)

from clustertrain.errors import ExitCode
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics
from clustertrain.train.status import read_status

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_to_one_rank_checkpoints_every_rank_and_asks_for_requeue(tmp_path, signum):
    proc = start(tmp_path, "train.steps=500", "checkpoint.every=0")
    wait_for_step(tmp_path, 3, proc)
    os.kill(children(proc.pid)[-1], signum)  # only the last rank hears it, as when Slurm signals one task
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.REQUEUE, stderr[-2000:]
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


SLOW_WRITE_S = 4.0  # each rank's shard write sleeps this long first (see slow_writes)
ASYNC = "checkpoint.async=true"


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """8 steps on 2 ranks with a synchronous save every 2: what every async run below must equal."""
    run_dir = tmp_path_factory.mktemp("sync")
    train(run_dir, "train.steps=8", "checkpoint.every=2", nproc=2)
    return run_dir


@pytest.fixture
def slow_writes(monkeypatch, tmp_path_factory):
    """Runs started from now on write their shards SLOW_WRITE_S late (until SLOW_WRITE_ENV is unset)."""
    slow_checkpoint_writes(monkeypatch, tmp_path_factory.mktemp("slowed-writer"), SLOW_WRITE_S)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_training_goes_on_while_an_async_save_is_being_written(tmp_path, sync_run, slow_writes, mode):
    """With a write slowed to SLOW_WRITE_S, step 3 is logged while step 2's shards are still being written
    (their DCP `.metadata`, written last, is missing); never with sync saves, whose write blocks the loop."""
    proc = start(tmp_path, "train.steps=8", "checkpoint.every=2", "train.stop_after_steps=3",  # sync_run's schedule
                 *([ASYNC] if mode == "async" else []))
    in_flight, seen, deadline = tmp_path / "checkpoints" / ".tmp-step-0000002", [], time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        logged = max(losses(tmp_path), default=0) if (tmp_path / "metrics.jsonl").exists() else 0
        # read in this order: the step first, then the folder, so a sync save (committed before step 3 runs)
        # can never be seen as in flight after step 3
        if logged >= 3 and in_flight.is_dir() and not (in_flight / ".metadata").exists():
            seen.append(logged)
        time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert bool(seen) == (mode == "async"), (
        f"{mode} saves: step 3 was {'' if seen else 'not '}logged while step 2's shards were being written")
    assert {s: losses(tmp_path)[s] for s in (1, 2, 3)} == {s: losses(sync_run)[s] for s in (1, 2, 3)}
    blocking = [r["checkpoint_blocking_s"] for r in read_metrics(tmp_path / "metrics.jsonl")
                if "checkpoint_blocking_s" in r]
    # the save of step 2 blocks the loop for the whole write when sync, for a host copy of the shards when async
    assert (blocking[0] < SLOW_WRITE_S / 2) if mode == "async" else (blocking[0] >= SLOW_WRITE_S), blocking
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000002", "step-0000003"]


def test_sigterm_during_an_async_write_completes_it_saves_and_resumes_exactly(tmp_path, sync_run, slow_writes,
                                                                                monkeypatch):
    proc = start(tmp_path, "train.steps=8", "checkpoint.every=2", ASYNC)
    assert wait_for_saves(tmp_path, proc, count=1), "the save of step 2 was not seen"
    os.kill(children(proc.pid)[-1], signal.SIGTERM)  # while step 2's write sleeps in the background
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.REQUEUE, stderr[-3000:]
    stopped = max(losses(tmp_path))
    assert f"stopped by SIGTERM at step {stopped}" in stderr and stopped in (2, 3)
    assert read_status(RunDir(tmp_path))["state"] == "preempted"
    # the write in flight completed and was committed; the stop saved its own step; nothing half-written is left
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted(
        {"step-0000002", f"step-{stopped:07d}"})
    monkeypatch.delenv(SLOW_WRITE_ENV)
    resumed = train(tmp_path, "train.steps=8", "checkpoint.every=2", ASYNC, nproc=2)
    assert f"resuming from {tmp_path / 'checkpoints' / f'step-{stopped:07d}'} at step {stopped}" in resumed.stdout
    assert losses(tmp_path) == losses(sync_run) and grad_norms(tmp_path) == grad_norms(sync_run)


def test_sigkill_during_an_async_write_leaves_no_partial_checkpoint_and_resumes_bit_identical(
        tmp_path, sync_run, slow_writes, monkeypatch):
    proc = start(tmp_path, "train.steps=8", "checkpoint.every=2", ASYNC)
    # the second save of this launch (step 4) is in flight: step 2's was committed before it started
    assert wait_for_saves(tmp_path, proc, count=2), "the save of step 4 was not seen"
    ranks = children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher; its ranks die with it (a parent-death signal)
    proc.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    checkpoints = tmp_path / "checkpoints"
    in_flight = checkpoints / ".tmp-step-0000004"
    assert in_flight.is_dir() and not (in_flight / ".metadata").exists(), "the kill should land mid-write"
    assert [p.name for p in checkpoints.glob("step-*")] == ["step-0000002"]
    assert (checkpoints / "step-0000002" / "train_state.json").exists()
    monkeypatch.delenv(SLOW_WRITE_ENV)
    resumed = train(tmp_path, "train.steps=8", "checkpoint.every=2", ASYNC, nproc=2)
    assert f"resuming from {checkpoints / 'step-0000002'} at step 2" in resumed.stdout
    assert not list(checkpoints.glob(".tmp-*"))
    ours, theirs = final_weights(tmp_path, 8), final_weights(sync_run, 8)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def small_files():
    """A 300 kB file-size limit: the checkpoint shards no longer fit, as on a full quota."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))


@pytest.mark.parametrize(("policy", "stop_after", "lost", "save"), [
    ("warn", None, "3-8", "sync"),  # steps 4 and 6 fail with a warning, then the final save at step 8
    ("warn", 2, "3-4", "sync"),  # the final save at train.stop_after_steps
    ("stop", None, None, "sync"),  # the first failure ends the run
    ("warn", None, "3-8", "async"),  # the writes fail in the background, seen when they are committed
])
def test_a_failed_write_keeps_the_previous_checkpoint_and_a_lost_final_save_fails_the_run(tmp_path, policy,
                                                                                           stop_after, lost, save):
    train(tmp_path, "train.steps=8", "checkpoint.every=2", "train.stop_after_steps=2")
    proc = start(tmp_path, "train.steps=8", "checkpoint.every=2", f"checkpoint.on_error={policy}",
                 *([f"train.stop_after_steps={stop_after}"] if stop_after else []),
                 *([ASYNC] if save == "async" else []), nproc=1, preexec_fn=small_files)
    stdout, stderr = proc.communicate(timeout=180)
    assert "checkpoint of step 4 failed" in stdout + stderr
    assert "step-0000002 is intact" in stdout + stderr
    assert proc.returncode == ExitCode.SAVE_FAILED, stderr[-2000:]
    assert "Traceback" not in stderr
    status = read_status(RunDir(tmp_path))
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
    assert proc.returncode == ExitCode.REQUEUE, stderr[-2000:]
    assert "stopped by walltime" in stderr
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 1
