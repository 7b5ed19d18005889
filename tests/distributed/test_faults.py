"""Faults under real processes: a run that goes NaN, Ctrl-C, signals during start-up, a launcher killed hard; and
every way a run ends leaves none of its processes (DataLoader workers) behind.

A lost final save is tested with the other failed writes in test_checkpoint.py (RLIMIT_FSIZE).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import RunProcesses, alive, children, final_weights, start, train, wait_for_saves, wait_for_step

from clustertrain.config.data_schema import DataConfig
from clustertrain.data.tokenize import train_bpe
from clustertrain.distributed.faults import FAULT_ENV
from clustertrain.errors import ExitCode
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics
from clustertrain.train.status import read_status

pytestmark = pytest.mark.dist

# After one AdamW update at this rate every weight is about ±1e18 and the next forward overflows: the
# first step is finite, every later one is NaN.
DIVERGING_LR = "optim.lr=1e18"


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def test_nan_stops_the_run_before_it_is_saved_and_the_last_good_checkpoint_stays(tmp_path):
    common = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=1",
              "metrics.log_every=100"]  # no log step between: the check before the save at step 6 is what stops it
    train(tmp_path, *common, "train.stop_after_steps=4")
    result = train(tmp_path, *common, DIVERGING_LR, expect=ExitCode.DIVERGED)
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: step 6: the loss (nan) or the gradient norm (nan) is not finite"), error
    assert "lower optim.lr (now 1e+18)" in error and "step-0000004" in error
    assert checkpoints(tmp_path) == ["step-0000004"]  # with keep_last=1, a save of step 6 would have deleted it
    status = read_status(RunDir(tmp_path))
    assert status["state"] == "failed" and status["step"] == 6 and "Diverged" in status["error"]


def test_nan_skip_skips_the_update_on_every_rank_and_gives_up_after_ten_in_a_row(tmp_path):
    result = train(tmp_path, "train.steps=14", "checkpoint.every=2", "train.on_nan=skip", DIVERGING_LR,
                   "parallel.strategy=zero3", nproc=2, expect=ExitCode.DIVERGED)
    assert "steps 2-11: 10 steps in a row had a non-finite loss or gradient norm" in result.stderr
    skipped = {r["step"]: r["nan_skipped"] for r in read_metrics(tmp_path / "metrics.jsonl") if "nan_skipped" in r}
    assert skipped[2] == 1 and skipped[11] == 10
    assert checkpoints(tmp_path) == ["step-0000006", "step-0000008", "step-0000010"]
    before, after = final_weights(tmp_path, 6), final_weights(tmp_path, 10)
    for name in before:  # both ranks' shards: no update between, on any rank
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("nproc, signum", [(None, signal.SIGTERM), (2, signal.SIGINT)],
                         ids=["one-rank-SIGTERM", "launcher-Ctrl-C"])
def test_a_signal_during_start_up_is_honoured_at_step_1(tmp_path, nproc, signum):
    """Ctrl-C saves and stops like SIGTERM, and neither is lost (or fatal) while torch loads or ranks start."""
    proc = start(tmp_path, "train.steps=500", "checkpoint.every=0", nproc=nproc, fresh=True)
    time.sleep(1)  # importing torch, or (launcher) starting the ranks
    os.killpg(proc.pid, signum)  # as a terminal does: the launcher's process group (each rank has its own)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.REQUEUE, stderr[-2000:]
    name = signal.Signals(signum).name
    assert f"{name} arrived while the run was starting: it saves and stops after step 1" in stdout
    assert f"stopped by {name} at step 1" in stderr
    assert checkpoints(tmp_path) == ["step-0000001"]
    status = read_status(RunDir(tmp_path))
    assert status["state"] == "preempted" and status["reason"] == name


def test_a_second_ctrl_c_exits_at_once_and_the_status_says_so(tmp_path):
    proc = start(tmp_path, "train.steps=500", "checkpoint.every=0", nproc=None)
    wait_for_step(tmp_path, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    assert wait_for_saves(tmp_path, proc, count=1), "no save after the first Ctrl-C"
    os.killpg(proc.pid, signal.SIGINT)  # while it saves
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    status = read_status(RunDir(tmp_path))
    assert status["state"] == "failed" and "second Ctrl-C" in status["error"], status


def test_ranks_die_with_a_launcher_killed_hard(tmp_path):
    proc = start(tmp_path, "train.steps=500", "checkpoint.every=0")
    wait_for_step(tmp_path, 2, proc)
    ranks = children(proc.pid)
    assert len(ranks) == 2
    assert all(os.getpgid(pid) == pid for pid in ranks), "each rank leads a process group of its own"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks), "orphaned ranks train on"
    assert checkpoints(tmp_path) == []



@pytest.fixture(scope="module")
def bad_jsonl(tmp_path_factory):
    """A JSONL file whose line 21 (stream 0's 21st document, read at step 6) is malformed, and a tokenizer."""
    root = tmp_path_factory.mktemp("data")
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) for i in range(400)]
    (root / "good.jsonl").write_text("\n".join(lines) + "\n")
    lines[20] = '{"text": 1 2}'
    (root / "bad.jsonl").write_text("\n".join(lines) + "\n")
    train_bpe(DataConfig.model_validate({"sources": [{"path": str(root / "good.jsonl")}], "vocab_size": 512}),
              root / "tokenizer")
    return root


# How each exit path is reached: (ranks, overrides, environment, what the test does once the run is at step 2, the
# exit code). One rank runs without a launcher, as under torchrun or srun: nothing reaps for it.
EXIT_PATHS = {
    "hang-76": (None, ["watchdog.heartbeat_s=0.5", "watchdog.step_timeout_s=2"], {FAULT_ENV: "collective@0:4=600"},
                None, ExitCode.HUNG),
    "preempted-75": (None, [], {}, "SIGTERM", ExitCode.REQUEUE),
    # step 3 waits 5 s, so that the file is in the way before the save at step 4 starts
    "lost-save-74": (None, ["checkpoint.every=4", "checkpoint.on_error=stop"], {FAULT_ENV: "collective@0:3=5"},
                     "a file in the way", ExitCode.SAVE_FAILED),
    "diverged-3": (None, [DIVERGING_LR], {}, None, ExitCode.DIVERGED),
    "user-error-2": (None, ["data.shuffle_buffer=1"], {}, None, 2),
    "rank-killed": (None, [], {}, "SIGKILL", -signal.SIGKILL),
    "rank-killed-under-nproc": (2, [], {}, "SIGKILL rank 1", 128 + signal.SIGKILL),
}


@pytest.mark.parametrize("path", EXIT_PATHS)
def test_every_exit_path_ends_the_run_s_own_processes(tmp_path, path, bad_jsonl, monkeypatch):
    """A worker blocked on its result pipe would live on, orphaned, where nothing reaps it: after each way a run
    ends, none of its processes (ranks, DataLoader workers) is left, and the workers did exist."""
    nproc, overrides, env, action, code = EXIT_PATHS[path]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data = [f"data.sources=[{{path: {bad_jsonl / 'bad.jsonl'}}}]",
            f"data.tokenizer={bad_jsonl / 'tokenizer'}"] if path == "user-error-2" else []
    proc = start(tmp_path, "train.steps=40", "checkpoint.every=0", "data.num_workers=1", *data, *overrides,
                 nproc=nproc)
    processes = RunProcesses(proc)
    if action:
        wait_for_step(tmp_path, 2, proc)
        if action == "a file in the way":  # of the checkpoint at step 4
            shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
            (tmp_path / "checkpoints").write_text("")
        else:
            victim = json.loads(RunDir(tmp_path).heartbeat(1).read_text())["pid"] if nproc else proc.pid
            os.kill(victim, getattr(signal, action.split()[0]))
    exit_code = proc.wait(timeout=120)
    left = processes.left()  # killed as well: the output's pipes close
    _, stderr = proc.communicate(timeout=30)
    assert exit_code == code, stderr[-3000:]
    assert "pt_data_worker" in processes.names.values(), f"no DataLoader worker ran\n{stderr[-3000:]}"
    assert not left, f"left running after exit {code}: {left}"
