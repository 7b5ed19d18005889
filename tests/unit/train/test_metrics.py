from __future__ import annotations

import io
import json
import math
import time

import pytest
import torch
from rich.console import Console

from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import MetricsLogger, format_duration, format_line, read_metrics


def console(buffer: io.StringIO, terminal: bool = False) -> Console:
    return Console(file=buffer, force_terminal=terminal, width=60)


def make(tmp_path, buffer=None, **kwargs) -> MetricsLogger:
    kwargs.setdefault("total_steps", 10)
    kwargs.setdefault("progress", "lines")
    kwargs.setdefault("tensorboard", False)
    return MetricsLogger(RunDir(tmp_path), console=console(buffer or io.StringIO()), **kwargs)


def test_format_line_known_input():
    metrics = {
        "loss": 5.12341,
        "lr": 3e-4,
        "grad_norm": 1.2345,
        "tokens_per_s": 12345.0,
        "mfu": 0.0123,
        "mem_gb": 0.4149,
        "eval_loss": None,
        "something_else": 7,
    }
    line = format_line(10, 300, metrics, 80.0)
    assert line == (
        "step  10/300 | loss 5.1234 | lr 3.00e-04 | gnorm 1.23 | 12.3k tok/s | mfu 1.2% | mem 0.41 GB | eta 1m20s"
    )
    assert format_line(3, 5, {"eval_loss": 2.5, "eval_ppl": 12.18}, None) == "step 3/5 | eval_loss 2.5000 | eval_ppl 12.18"


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 80, 7500, 190000)] == ["0s", "59s", "1m20s", "2h05m", "2d04h"]


def test_jsonl_written_flushed_and_parseable(tmp_path):
    log = make(tmp_path)
    before = time.time()
    log.log(1, {"loss": 4.0, "lr": torch.tensor(1e-3), "mfu": None})
    # Flushed per line: readable before close, as after a kill.
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["step"] == 1
    log.log(2, {"loss": float("nan")})
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    # The wall clock, unix seconds rounded to the millisecond.
    assert before - 0.001 <= records[0]["time"] <= records[1]["time"] <= time.time() + 0.001
    assert records[0]["loss"] == 4.0 and records[0]["lr"] == pytest.approx(1e-3)
    assert "mfu" in records[0] and records[0]["mfu"] is None
    assert records[0]["eta_s"] is None
    assert math.isnan(records[1]["loss"])
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        assert isinstance(json.loads(line), dict)


def test_resume_appends_to_same_file(tmp_path):
    with make(tmp_path) as log:
        log.log(1, {"loss": 3.0})
        log.log(2, {"loss": 2.0})
    # A killed run may leave half a line behind.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')
    with make(tmp_path, start_step=2) as log:
        log.log(3, {"loss": 1.0})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 3.0), (2, 2.0), (3, 1.0)]


def test_tensorboard_scalars_read_back_grouped_with_the_config_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with make(tmp_path, tensorboard=True) as log:
        log.describe("optim:\n  lr: 0.001\n", {"peak_bytes": 123})
        log.log(1, {"loss": 3.5, "lr": 1e-3, "note": "text", "mfu": None, "tokens_per_s": 900.0, "mem_gb": 0.5,
                    "mix/web": 0.25, "data_skipped": 2})
        log.log(2, {"loss": 2.5, "lr": 2e-3, "mfu": 0.125})
        log.log(2, {"eval_loss": 2.75, "eval_ppl": 15.6})
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/lr", "perf/tokens_per_s", "perf/mem_gb", "perf/mfu",
                                          "data/mix/web", "data/skipped", "eval/loss", "eval/ppl"}
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 3.5), (2, 2.5)]
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2]
    assert acc.Scalars("train/lr")[1].value == pytest.approx(2e-3)
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(2, 2.75)]
    assert [(e.step, e.value) for e in acc.Scalars("perf/mfu")] == [(2, 0.125)]
    assert [(e.step, e.value) for e in acc.Scalars("data/mix/web")] == [(1, 0.25)]
    records = read_metrics(tmp_path / "metrics.jsonl")  # metrics.jsonl keeps the flat keys, and its time is TB's
    assert acc.Scalars("train/loss")[0].wall_time == pytest.approx(records[0]["time"], abs=1e-3)
    texts = {tag: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    assert texts == {"config/text_summary": "    optim:\n      lr: 0.001",
                     "plan/text_summary": '    {\n     "peak_bytes": 123\n    }'}


def test_disabled_logger_writes_nothing(tmp_path):
    buffer = io.StringIO()
    run_dir = tmp_path / "run"
    log = make(run_dir, buffer, enabled=False, tensorboard=True)
    log.log(1, {"loss": 1.0})
    log.info("hello")
    log.close()
    assert not run_dir.exists()
    assert buffer.getvalue() == ""


def test_eta_none_first_then_positive(tmp_path, monkeypatch):
    clock = iter([100.0, 101.0, 103.0])
    monkeypatch.setattr("clustertrain.train.metrics.time.perf_counter", lambda: next(clock))
    with make(tmp_path, total_steps=10) as log:
        log.log(1, {"loss": 1.0})
        log.log(2, {"loss": 1.0})
        log.log(3, {"loss": 1.0})
    etas = [r["eta_s"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    # 1 s/step after step 2 (8 left); then (103-100)/2 = 1.5 s/step averaged (7 left).
    assert etas == [None, 8.0, 10.5]


def test_lines_mode_prints_one_unwrapped_line_per_log(tmp_path):
    buffer = io.StringIO()
    with make(tmp_path, buffer, total_steps=300) as log:
        log.info("starting")
        log.log(10, {"loss": 5.0, "lr": 3e-4, "grad_norm": 1.0, "tokens_per_s": 1e4, "mfu": 0.5, "mem_gb": 1.0})
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "starting"
    # Longer than the 60-column console, still one line.
    assert len(lines) == 2 and len(lines[1]) > 60 and lines[1].startswith("step  10/300 | loss 5.0000")


def test_none_mode_prints_no_progress_but_writes_files(tmp_path):
    buffer = io.StringIO()
    with make(tmp_path, buffer, progress="none") as log:
        log.log(1, {"loss": 1.0})
    assert buffer.getvalue() == ""
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1


def test_auto_mode_picks_bar_on_terminal_and_lines_otherwise(tmp_path):
    bar = MetricsLogger(RunDir(tmp_path / "a"), total_steps=5, tensorboard=False, console=console(io.StringIO(), True))
    plain = MetricsLogger(RunDir(tmp_path / "b"), total_steps=5, tensorboard=False, console=console(io.StringIO()))
    try:
        assert (bar.mode, plain.mode) == ("bar", "lines")
    finally:
        bar.close()
        plain.close()


def test_bar_mode_runs_and_keeps_info_lines(tmp_path):
    buffer = io.StringIO()
    with make(tmp_path, buffer, progress="bar", total_steps=4) as log:
        log.info("hello from info")
        for step in range(1, 5):
            log.log(step, {"loss": 1.0 / step, "tokens_per_s": 2000.0})
        log.log(4, {"eval_loss": 0.5})
    out = buffer.getvalue()
    assert "hello from info" in out
    assert "eval_loss 0.5000" in out
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 5


def test_bad_progress_mode(tmp_path):
    with pytest.raises(ValueError, match="progress"):
        MetricsLogger(RunDir(tmp_path), total_steps=1, progress="fancy")


def test_tensorboard_resume_hides_steps_after_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with make(tmp_path, tensorboard=True, total_steps=4) as log:
        for step in range(1, 5):
            log.log(step, {"loss": float(step)})
    # Resumed from the checkpoint at step 2: the killed run's steps 3-4 are replaced. TensorBoard reads event files
    # in name order: time in seconds, pid, then a per-process counter (where "10" sorts before "9"); a resumed run
    # is a later process, so this one starts in a later second.
    time.sleep(1.01 - time.time() % 1)
    with make(tmp_path, tensorboard=True, total_steps=4, start_step=2) as log:
        for step in range(3, 5):
            log.log(step, {"loss": 10.0 + step})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


@pytest.mark.parametrize("progress", ["lines", "bar"])
def test_a_closed_stdout_silences_the_console_and_the_run_goes_on(tmp_path, monkeypatch, progress):
    """`clustertrain train | head -4`: once the reader is gone, output stops and the logger goes on (rich alone
    answers a closed pipe with SystemExit(1)); stdout then points at /dev/null, so the exit flush cannot fail."""
    import os

    read_end, write_end = os.pipe()
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr("sys.stdout", stdout)
    try:
        with MetricsLogger(RunDir(tmp_path), total_steps=4, tensorboard=False, progress=progress) as log:
            log.info("starting")
            os.close(read_end)  # the reader went away
            for step in range(1, 5):
                log.log(step, {"loss": 1.0 / step})
                log.info(f"after step {step}")
        assert log.console.quiet
        print("text for nobody", file=stdout, flush=True)  # the descriptor is /dev/null now
        assert os.path.samestat(os.fstat(stdout.fileno()), os.stat(os.devnull))
    finally:
        stdout.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
