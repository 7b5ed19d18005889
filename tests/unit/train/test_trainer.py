"""Trainer pieces, in this process: without a process group, or one rank."""

from __future__ import annotations

import sys

import pytest

from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import MetricsLogger
from clustertrain.train.sample import sample_or_warn
from clustertrain.train.status import read_status
from clustertrain.train.trainer import Trainer


def test_a_failed_sample_is_one_warning_not_a_failed_run(tmp_path, capsys):
    logger = MetricsLogger(RunDir(tmp_path), total_steps=1, start_step=1, enabled=True, tensorboard=False,
                           progress="lines")

    def broken():
        raise RuntimeError("aten.embedding.default got mixed torch.Tensor and DTensor")

    assert sample_or_warn(broken, logger.info, tmp_path) is None
    out = capsys.readouterr().out
    assert "warning: the end-of-run sample failed (RuntimeError: aten.embedding" in out
    assert f"clustertrain generate {tmp_path}" in out


@pytest.mark.dist  # builds and starts the tiny model in this process
def test_a_run_ended_by_system_exit_is_recorded_failed(tmp_path, monkeypatch):
    """rich answers a closed stdout with SystemExit(1); whatever raises it, status.json must not stay "running"."""
    from helpers import TINY

    from clustertrain.config.load import load_config

    monkeypatch.setattr(Trainer, "train_steps", lambda self, n: sys.exit(1))
    with pytest.raises(SystemExit):
        Trainer(load_config(None, [*TINY, f"train.run_dir={tmp_path}", "train.steps=2"])).run()
    status = read_status(RunDir(tmp_path))
    assert status["state"] == "failed", status
    assert (status["step"], status["error"]) == (0, "SystemExit: 1")
