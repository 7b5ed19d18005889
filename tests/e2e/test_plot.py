"""`clustertrain plot`: the curves of real runs as a PNG, several runs in one chart, and one line (exit 2) when
matplotlib is missing or a folder is no run."""

from __future__ import annotations

import shutil
import sys

import pytest
from helpers import run_cli, train

from clustertrain.cli import main
from clustertrain.train.plots import run_curves

pytestmark = pytest.mark.dist  # trains


def test_plot_draws_loss_eval_loss_and_throughput_of_several_runs(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    train(tmp_path / "a", "train.steps=6", "train.eval_every=3", "train.eval_batches=1", "metrics.log_every=2")
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # a second run to compare with, without training it again
    curves = run_curves(tmp_path / "a")
    assert [step for step, _ in curves["loss"]] == [1, 2, 4, 6] and len(curves["tokens_per_s"]) == 4
    assert [step for step, _ in curves["eval_loss"]] == [3, 6]

    result = run_cli("plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "compare.png"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'compare.png'}"
    image = plt.imread(tmp_path / "compare.png")
    assert image.shape[:2] == (400, 1100) and image.std() > 0
    assert main(["plot", str(tmp_path / "a")]) == 0 and (tmp_path / "a" / "curves.png").is_file()


def test_without_matplotlib_or_metrics_one_line_says_what_to_do(tmp_path, monkeypatch, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'metrics.jsonl'} does not exist: is {tmp_path} a run " \
        "directory (train.run_dir)?\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: plotting needs matplotlib, which is not installed: " \
        "pip install 'clustertrain[plot]'\n"
    assert main(["slurm", "scaling", str(tmp_path)]) == 2
    assert "pip install 'clustertrain[plot]'" in capsys.readouterr().err
