"""One owner per run directory (clustertrain.train.lock), and refused starts that leave the directory as it was.

The lock's rules are tested in-process (cheap); real runs show a second run refused on every rank while the
first goes on intact, a dead holder's lock taken over, and refusals that write nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import losses, start, train, wait_for_step

from clustertrain.cli.logs import setup_logging
from clustertrain.errors import ExitCode
from clustertrain.run_dir import RunDir
from clustertrain.train.lock import LOCK_FILE, STALE_AFTER_S, Holder, RunDirLocked, RunLock, lock_run_dir, read_holder
from clustertrain.train.status import read_status

pytestmark = pytest.mark.dist


def dead_pid() -> int:
    """The id of a process of this host that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def plant_lock(run_dir: Path, age_s: float = 0.0, **fields) -> Holder:
    """A lock file as another run would have left it, its heartbeat `age_s` old."""
    holder = Holder(**{"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None, "slurm_restart": 0,
                       "since": time.time() - 3600, "token": "theirs", **fields})
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps(vars(holder)))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return holder


def snapshot(run_dir: Path) -> dict[str, float]:
    """Every path under `run_dir` with its modification time: what a refused start must not change."""
    return {str(p.relative_to(run_dir)): p.stat().st_mtime for p in sorted(run_dir.rglob("*"))}


# ---- the lock's rules, in-process --------------------------------------------------------------
def test_a_held_lock_refuses_a_second_holder_by_name_and_release_frees_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run_dir = tmp_path / "runs" / "a"
    first = RunLock.acquire(RunDir(run_dir))
    try:
        assert read_holder(run_dir / LOCK_FILE) == first.holder
        with pytest.raises(RunDirLocked) as refused:
            RunLock.acquire(RunDir(run_dir))
        message = str(refused.value)
        assert "\n" not in message and f"{run_dir} is in use by another run (pid {os.getpid()} on " in message
        assert f"{socket.gethostname()}, Slurm job 4242, since " in message
        assert f"delete {run_dir / LOCK_FILE}" in message
    finally:
        first.release()
    assert not (tmp_path / "runs").exists()  # acquire() made runs/a; empty, both go with the lock
    second = RunLock.acquire(RunDir(run_dir))
    second.release()


def test_the_heartbeat_refreshes_the_lock_and_warns_once_it_was_taken_over(tmp_path, monkeypatch, capsys):
    setup_logging("info")
    monkeypatch.setattr("clustertrain.train.lock.HEARTBEAT_S", 0.05)
    lock = RunLock.acquire(RunDir(tmp_path))
    try:
        path = tmp_path / LOCK_FILE
        os.utime(path, (0, 0))
        deadline = time.monotonic() + 10
        while path.stat().st_mtime < time.time() - 60 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.stat().st_mtime > time.time() - 60
        plant_lock(tmp_path, host="elsewhere")
        lock._thread.join(timeout=10)
        assert not lock._thread.is_alive()
        warning = capsys.readouterr().err
        assert f"warning: the lock of {tmp_path} was taken over by pid {os.getpid()} on elsewhere" in warning
    finally:
        lock.release()


def test_release_keeps_a_lock_that_another_run_took_over(tmp_path):
    lock = RunLock.acquire(RunDir(tmp_path))
    theirs = plant_lock(tmp_path)
    lock.release()
    assert read_holder(tmp_path / LOCK_FILE) == theirs


@pytest.mark.parametrize(("fields", "age_s", "why"), [
    ({"pid": "dead"}, 0, "its process {pid} on {host} is gone"),
    ({"host": "elsewhere"}, STALE_AFTER_S + 60, "its heartbeat is"),
    ({"host": "elsewhere", "slurm_job_id": "77", "slurm_restart": 0}, 0, "this Slurm job's earlier start"),
], ids=["dead-pid", "old-heartbeat", "requeued-job"])
def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, monkeypatch, fields, age_s, why):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    if fields.get("pid") == "dead":
        fields = {**fields, "pid": dead_pid()}
    stale = plant_lock(tmp_path, age_s, **fields)
    notes: list[str] = []
    lock = RunLock.acquire(RunDir(tmp_path), note=notes.append)
    try:
        assert lock.owned() and lock.holder.pid == os.getpid()
        assert len(notes) == 1 and f"took over the lock of {tmp_path} from pid {stale.pid}" in notes[0]
        assert why.format(pid=stale.pid, host=stale.host) in notes[0]
    finally:
        lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("fields", [
    {"host": "elsewhere"},  # a live heartbeat from another host: its pid cannot be checked from here
    {"host": "elsewhere", "slurm_job_id": "77", "slurm_restart": 1},  # our job's own start: a concurrent run
], ids=["other-host", "same-job-same-restart"])
def test_a_live_lock_is_not_taken_over(tmp_path, monkeypatch, fields):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    theirs = plant_lock(tmp_path, **fields)
    with pytest.raises(RunDirLocked, match=f"pid {theirs.pid} on elsewhere"):
        RunLock.acquire(RunDir(tmp_path))
    assert read_holder(tmp_path / LOCK_FILE) == theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # no leftovers of the attempt


def test_without_a_process_group_rank_0_locks_alone(tmp_path):
    lock = lock_run_dir(RunDir(tmp_path / "run"), rank0=True)
    assert lock is not None and lock.owned()
    lock.release()
    with pytest.raises(RunDirLocked, match="cannot use"):
        (tmp_path / "file").write_text("")
        lock_run_dir(RunDir(tmp_path / "file" / "run"), rank0=True)


# ---- real runs ---------------------------------------------------------------------------------
def test_a_second_run_on_a_held_directory_exits_2_on_every_rank_and_the_first_goes_on(tmp_path):
    first = start(tmp_path, "train.steps=100000", "checkpoint.every=2", "checkpoint.keep_last=1", nproc=None)
    try:
        wait_for_step(tmp_path, 2, first)
        second = train(tmp_path, "train.steps=4", nproc=2, extra_args=("--overwrite",), expect=2)
        assert "Traceback" not in second.stderr
        lines = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, second.stderr
        assert f"is in use by another run (pid {first.pid} on {socket.gethostname()}, since " in lines[0]
        assert first.poll() is None
        stopped_at = max(losses(tmp_path))
        wait_for_step(tmp_path, stopped_at + 2, first)  # still training, its files untouched
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == ExitCode.REQUEUE, stderr[-3000:]
    assert read_status(RunDir(tmp_path))["state"] == "preempted"
    steps = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r.get("loss") is not None]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved or repeated steps
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert saved == [f"step-{max(steps):07d}"] and not list(tmp_path.glob("replaced-*"))
    assert not (tmp_path / LOCK_FILE).exists()  # released on the preempted path


def test_a_dead_runs_lock_is_taken_over_and_a_refused_resume_leaves_the_run_finished(tmp_path):
    plant_lock(tmp_path, pid=dead_pid())
    result = train(tmp_path, "train.steps=2")
    assert "note: took over the lock of" in result.stdout + result.stderr
    assert read_status(RunDir(tmp_path))["state"] == "finished" and not (tmp_path / LOCK_FILE).exists()
    before = snapshot(tmp_path)
    refused = train(tmp_path, "train.steps=2", "data.shuffle_buffer=512", expect=2)
    error = refused.stderr.strip().splitlines()[-1]
    assert error == ("error: the checkpoint's data position was taken over other data: "
                     "data.shuffle_buffer: 1024 -> 512; restore it to resume"), refused.stderr
    assert snapshot(tmp_path) == before
    assert read_status(RunDir(tmp_path))["state"] == "finished"


def test_a_refused_start_leaves_no_run_directory(tmp_path):
    result = train(tmp_path / "runs" / "new", "data.sources=[{path: missing.jsonl}]", expect=2)
    assert "data source 'missing.jsonl': no such file" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # neither runs/ nor runs/new: no status.json, no lock
