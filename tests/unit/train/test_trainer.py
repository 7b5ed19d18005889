"""Trainer pieces that need no process group."""

from __future__ import annotations

from clustertrain.train.metrics import MetricsLogger
from clustertrain.train.trainer import Trainer


def test_a_failed_sample_is_one_warning_not_a_failed_run(tmp_path, capsys):
    trainer = Trainer.__new__(Trainer)  # only the sample guard is under test
    trainer.run_dir = tmp_path
    trainer.logger = MetricsLogger(tmp_path, total_steps=1, start_step=1, enabled=True, tensorboard=False,
                                   progress="lines")

    def broken(prompt, max_new_tokens):
        raise RuntimeError("aten.embedding.default got mixed torch.Tensor and DTensor")

    trainer.sample = broken
    assert trainer._sample_or_warn("def ", 4) is None
    out = capsys.readouterr().out
    assert "warning: the end-of-run sample failed (RuntimeError: aten.embedding" in out
    assert f"clustertrain generate {tmp_path}" in out
