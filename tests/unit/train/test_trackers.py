"""The trackers' names for metrics, the one line for a tracker whose package is missing (before anything trains),
a tracker that cannot start, fails, stalls or falls behind leaving the run to train without it (one warning, the
caller never waits), and a resume that cannot continue its tracker runs saying so. Training with them:
tests/e2e/test_train_trackers.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from clustertrain.cli import main
from clustertrain.cli.logs import setup_logging
from clustertrain.config.metrics_schema import MetricsConfig
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import MetricsLogger, read_metrics
from clustertrain.train.trackers import QUEUE_CALLS, Tracker, TrackerThread, open_trackers, tag


def test_metrics_are_grouped_train_eval_perf_data():
    keys = ["loss", "lr", "grad_norm", "tokens", "loss_scale", "eval_loss", "eval_ppl", "eval_exact_match",
            "tokens_per_s", "tokens_per_s_per_rank", "mfu", "mem_gb", "mem_reserved_gb", "load_mem_gb",
            "checkpoint_blocking_s", "data_skipped", "mix/web"]
    assert [tag(k) for k in keys] == [
        "train/loss", "train/lr", "train/grad_norm", "train/tokens", "train/loss_scale", "eval/loss", "eval/ppl",
        "eval/exact_match", "perf/tokens_per_s", "perf/tokens_per_s_per_rank", "perf/mfu", "perf/mem_gb",
        "perf/mem_reserved_gb", "perf/load_mem_gb", "perf/checkpoint_blocking_s", "data/skipped", "data/mix/web"]


@pytest.mark.parametrize("module", ["wandb", "mlflow"])
@pytest.mark.parametrize("command", ["config check --world 1", "train"])
def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys, module, command):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    argv = [*command.split(), "--set", f"metrics.{module}.enabled=true", "--set", f"train.run_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"error: metrics.{module}.enabled needs {module}, which is not installed: "
                                       f"pip install 'clustertrain[{module}]'\n")
    assert not (tmp_path / "run").exists()  # refused before the run started


def test_the_exit_code_of_a_real_process_is_2_without_a_traceback(tmp_path):
    code = ("import sys; sys.modules['wandb'] = None; from clustertrain.cli import main; "
            f"sys.exit(main(['train', '--set', 'metrics.wandb.enabled=true', '--set', 'train.run_dir={tmp_path}']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.endswith("pip install 'clustertrain[wandb]'\n"), result.stderr
    assert "Traceback" not in result.stderr


def test_a_tracker_that_cannot_start_is_left_out_and_the_run_goes_on(tmp_path, capsys):
    setup_logging("info")
    metrics = MetricsConfig(mlflow={"enabled": True, "tracking_uri": "nosuchscheme://nowhere"})
    (mlflow,) = open_trackers(metrics, RunDir(tmp_path), "run", "optim:\n  lr: 0.001\n", None)
    mlflow.close(failed=False)
    mlflow.join()
    out = capsys.readouterr().err
    assert out.startswith("warning: MLflow could not start (") and out.endswith(
        "the run goes on without it, metrics.jsonl has every number\n") and out.count("\n") == 1, out
    assert mlflow.dropped and not RunDir(tmp_path).trackers.exists()  # no id to continue


class ServerGone(Tracker):
    kind = "Gone"

    def __init__(self):
        self.calls = 0

    def log(self, step, values, time_s):
        self.calls += 1
        raise ConnectionError("server gone")

    def close(self, failed):
        raise AssertionError("a failed tracker is not called again")


@pytest.mark.parametrize("level", ["info", "error"])
def test_a_tracker_that_fails_says_so_once_and_the_run_logs_on(tmp_path, capsys, level):
    setup_logging(level)
    gone = ServerGone()
    with MetricsLogger(RunDir(tmp_path), total_steps=3, tensorboard=False, progress="none",
                       trackers=(TrackerThread("Gone", lambda: gone, limit_s=30),)) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": 1.0 / step})
            time.sleep(0.05)  # its thread logs, and fails, meanwhile
    assert gone.calls == 1
    said = "warning: Gone failed (server gone); the run goes on without it, metrics.jsonl has every number\n"
    assert capsys.readouterr().err == (said if level == "info" else "")  # --log-level error: errors only
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


class Stalled(Tracker):
    """A tracker whose server stops answering at its first log: the call blocks until the test ends."""

    kind, line = "Stalled", "Stalled: run 7"

    def __init__(self):
        self.logged, self.answer = [], threading.Event()

    def log(self, step, values, time_s):
        self.logged.append(step)
        self.answer.wait()

    def close(self, failed):
        raise AssertionError("a dropped tracker is not called again")


def test_a_tracker_whose_log_blocks_never_blocks_the_caller_and_is_dropped_past_its_limit(tmp_path, capsys):
    setup_logging("info")
    stalled = Stalled()
    thread = TrackerThread("Stalled", lambda: stalled, limit_s=0.5)
    try:
        with MetricsLogger(RunDir(tmp_path), total_steps=30, tensorboard=False, progress="lines",
                           trackers=(thread,)) as log:
            waited = []
            for step in range(1, 31):
                began = time.monotonic()
                log.log(step, {"loss": 1.0})
                waited.append(time.monotonic() - began)
                time.sleep(0.05)  # 1.5 s of steps: the limit passes at about step 10
            assert thread.dropped  # before the end of the run, not only at close
            began = time.monotonic()
        closed_in = time.monotonic() - began
    finally:
        stalled.answer.set()
    assert max(waited) < 0.25 and closed_in < 0.25, (waited, closed_in)
    assert stalled.logged == [1]  # the one call that never answered
    out = capsys.readouterr()
    assert out.err == ("warning: Stalled did not answer within 0.5s (log); the run goes on without it, "
                       "metrics.jsonl has every number\n")
    assert "Stalled: run 7" in out.out  # its start line, said by the caller once it had opened
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 30


def test_a_tracker_that_falls_behind_is_dropped_and_the_closing_wait_is_bounded(capsys):
    setup_logging("info")
    stalled = Stalled()
    thread = TrackerThread("Stalled", lambda: stalled, limit_s=60)
    try:
        began = time.monotonic()
        for step in range(1, QUEUE_CALLS + 3):  # one in the call that blocks, QUEUE_CALLS waiting, one too many
            thread.log(step, {"train/loss": 1.0}, 0.0)
        thread.close(failed=False)
        thread.join()
        assert time.monotonic() - began < 5
    finally:
        stalled.answer.set()
    assert capsys.readouterr().err == (f"warning: Stalled fell {QUEUE_CALLS} calls behind; the run goes on without "
                                       "it, metrics.jsonl has every number\n")
    closing = Stalled()
    closing.close = lambda failed: closing.answer.wait()  # a close that never answers: waited for at most 0.5 s
    thread = TrackerThread("Stalled", lambda: closing, limit_s=0.5)
    try:
        began = time.monotonic()
        thread.close(failed=False)
        thread.join()
        assert 0.4 < time.monotonic() - began < 2
    finally:
        closing.answer.set()
    assert capsys.readouterr().err.startswith("warning: Stalled did not answer within 0.5s (close); the run goes on")


@pytest.mark.parametrize("ids", [None, "{}", "not json", '{"mlflow": "found"}'])
def test_a_resume_that_cannot_continue_its_tracker_run_says_it_starts_a_new_one(tmp_path, capsys, ids):
    setup_logging("info")
    files = RunDir(tmp_path)
    if ids is not None:
        files.trackers.write_text(ids)
    metrics = MetricsConfig(mlflow={"enabled": True})
    said = {}
    for resumed in (False, True):
        (mlflow,) = open_trackers(metrics, files, "run", "optim:\n  lr: 0.001\n", None, resumed=resumed)
        if resumed:
            said = capsys.readouterr().err  # at once, before it opened
        mlflow.close(failed=False)
        mlflow.join()
        assert not mlflow.dropped
        files.trackers.write_text(ids or "") if ids is not None else files.trackers.unlink()
    why = {None: "is missing", "{}": "has no MLflow run id", "not json": "cannot be read"}
    assert said == (f"warning: {files.trackers} {why[ids]}; this resumed run starts a new MLflow run\n"
                    if ids in why else "")  # a first start, or an id to continue (gone: a new run too), says nothing


@pytest.mark.parametrize("stalls", [True, False])
def test_a_process_whose_dropped_tracker_is_still_in_its_call_ends_without_the_interpreter_s_shutdown(stalls):
    """The shutdown would end the stalled daemon thread wherever it is: inside a library's C++ code that aborted a
    finished run (exit -6, "FATAL: exception not rethrown"). Such a process ends by os._exit with its code, which
    skips the shutdown (and its atexit handlers); one without a stalled tracker shuts down as always."""
    code = ("import atexit, sys, time\nfrom clustertrain.cli import main\nfrom clustertrain.train import trackers\n"
            f"thread = trackers.TrackerThread('Stub', lambda: time.sleep({60 if stalls else 0}), 0.5)\n"
            "thread.close(False)\nthread.join()\natexit.register(lambda: print('shut down'))\n"
            "sys.argv = ['clustertrain']\nraise SystemExit(main())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ("shut down" in result.stdout) is not stalls
