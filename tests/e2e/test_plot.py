"""`clustertrain plot`: the curves of a real run and its resume as a PNG, stitched, several runs in one chart, and one
line (exit 2) when matplotlib is missing or a folder is no run."""

from __future__ import annotations

import shutil
import sys

import pytest
from helpers import run_cli, train

from clustertrain.cli import main
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics
from clustertrain.train.plots import run_curves

pytestmark = pytest.mark.dist  # trains


def test_plot_stitches_a_resumed_run_and_overlays_several_runs(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    run = tmp_path / "a"
    train(run, "train.steps=6", "train.eval_every=3", "train.eval_batches=1", "metrics.log_every=2",
          "checkpoint.every=2")
    # A restart that does steps 5-6 again, as after a kill before step 6's save: resumed from step 4.
    shutil.rmtree(run / "checkpoints" / "step-0000006")
    train(run, "train.steps=6", "train.eval_every=3", "train.eval_batches=1", "metrics.log_every=2",
          "checkpoint.every=2")
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 4, 6, 6]  # the restart logs step 6 again
    a = run_curves(RunDir(run))
    assert a.name == "a" and a.resumes == [4]
    for key in ("loss", "lr", "tokens_per_s", "mfu", "mem_gb"):  # each step once, the restart's record last
        last = {r["step"]: r[key] for r in records if r.get(key) is not None}
        scale = 100 if key == "mfu" else 1
        assert a.curves[key] == [(step, value * scale) for step, value in sorted(last.items())], key
        assert [step for step, _ in a.curves[key]] == [1, 2, 4, 6]
    speeds = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") is not None]
    assert a.curves["tokens_per_s"][-1] == (6, speeds[-1]) != (6, speeds[-2])  # the restart's, not the killed run's
    assert [step for step, _ in a.curves["eval_loss"]] == [3, 6]
    assert a.curves["mem_reserved_gb"] == []  # GPUs only: no dashed line, no label for it

    shutil.copytree(run, tmp_path / "b")  # a second run to compare with, without training it again
    result = run_cli("plot", str(run), str(tmp_path / "b"), "-o", str(tmp_path / "compare.png"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'compare.png'}"
    image = plt.imread(tmp_path / "compare.png")
    assert image.shape[:2] == (800, 1650) and image.std() > 0  # 5 panels: loss, lr, tokens/s, MFU, memory
    assert main(["plot", str(run)]) == 0 and (run / "curves.png").is_file()


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
