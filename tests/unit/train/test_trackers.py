"""The trackers' names for metrics, the one line for a tracker whose package is missing (before anything trains),
and a tracker that cannot start or fails leaving the run to train without it. Training with them:
tests/e2e/test_train_trackers.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clustertrain.cli import main
from clustertrain.cli.logs import setup_logging
from clustertrain.config.schema import MetricsConfig
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import MetricsLogger, read_jsonl
from clustertrain.train.trackers import Tracker, open_trackers, tag


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
    assert open_trackers(metrics, RunDir(tmp_path), "run", "optim:\n  lr: 0.001\n", None) == ()
    out = capsys.readouterr().err
    assert out.startswith("warning: MLflow could not start (") and out.endswith("the run goes on without it\n")
    assert not RunDir(tmp_path).trackers.exists()  # no id to continue


class ServerGone(Tracker):
    key, kind = "gone", "Gone"

    def __init__(self):
        self.calls = 0

    def _log(self, step, values, time_s):
        self.calls += 1
        raise ConnectionError("server gone")

    def _close(self, failed):
        raise AssertionError("a failed tracker is not called again")


@pytest.mark.parametrize("level", ["info", "error"])
def test_a_tracker_that_fails_says_so_once_and_the_run_logs_on(tmp_path, capsys, level):
    setup_logging(level)
    gone = ServerGone()
    with MetricsLogger(tmp_path, total_steps=3, tensorboard=False, progress="none", trackers=(gone,)) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": 1.0 / step})
    assert gone.calls == 1
    said = "warning: Gone failed (server gone); the run goes on without it, metrics.jsonl has every number\n"
    assert capsys.readouterr().err == (said if level == "info" else "")  # --log-level error: errors only
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
