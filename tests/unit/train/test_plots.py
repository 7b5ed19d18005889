"""`clustertrain plot` on a hostile metrics.jsonl, in-process through the CLI's main(): exit 2 and one `error:` line
naming the file and line, never a traceback. What a run writes (NaN, null, a cut last line) still plots."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
from helpers import run_cli

from clustertrain.cli import main
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import LINE_LIMIT
from clustertrain.train.plots import run_curves

GOOD = [json.dumps({"step": s, "loss": 5.0 / s, "tokens_per_s": 1000.0, "eta_s": None}) for s in range(1, 5)]


def lines(*bad: str, at: int = 2) -> str:
    """The good records with `bad` lines in place of line `at`, each line ending with its newline."""
    return "".join(line + "\n" for line in [*GOOD[: at - 1], *bad, *GOOD[at:]])


BAD = {
    "not JSON": (lines("not json"), r"2: malformed JSON \(Expecting value at column 1\)"),
    "half an object mid-file": (lines('{"step": 2, "lo'), r"2: malformed JSON \(Unterminated string"),
    "a bad last line that has its newline": (lines("{", at=4), r"4: malformed JSON"),
    "an array": (lines("[1, 2]"), r"2: not a JSON object \(got array\)"),
    "null": (lines("null"), r"2: not a JSON object \(got null\)"),
    "a number": (lines("7"), r"2: not a JSON object \(got number\)"),
    "nested too deeply": (lines("[" * 100_000), r"2: malformed JSON \(nested too deeply\)"),
    "a 5,000-digit loss": (lines('{"step": 2, "loss": ' + "9" * 5000 + "}"), r"2: malformed JSON \(Exceeds the limit"),
    "not UTF-8": (lines('{"step": 2, "loss": "\xff"}'.encode("latin-1").decode("utf-8", "surrogateescape")),
                  r"2: not UTF-8 text \(byte 0xff at column 22\)"),
    "no step": (lines('{"loss": 1.0}'), r"2: 'step' is missing; each record needs a whole number of steps >= 0"),
    "a step that is a string": (lines('{"step": "2", "loss": 1.0}'), r"2: 'step' is string \"2\""),
    "a step that is a float": (lines('{"step": 2.5, "loss": 1.0}'), r"2: 'step' is number 2.5;"),
    "a step that is true": (lines('{"step": true, "loss": 1.0}'), r"2: 'step' is boolean true;"),
    "a negative step": (lines('{"step": -1, "loss": 1.0}'), r"2: 'step' is number -1;"),
    "a loss that is a string": (lines('{"step": 2, "loss": "low"}'),
                                r"2: 'loss' is string \"low\"; it must be a number or null"),
    "a loss that is a list": (lines('{"step": 2, "loss": [1]}'), r"2: 'loss' is array \[1\];"),
    "an eval loss that is an object": (lines('{"step": 2, "eval_loss": {"a": 1}}'), r"2: 'eval_loss' is object {\"a\": 1};"),
    "tokens/s that is a boolean": (lines('{"step": 2, "tokens_per_s": false}'), r"2: 'tokens_per_s' is boolean false;"),
    "a loss past a float": (lines('{"step": 2, "loss": 1' + "0" * 400 + "}"), r"2: 'loss' is number 10{39};"),
}


@pytest.mark.parametrize("text, message", BAD.values(), ids=BAD.keys())
def test_a_bad_metrics_file_is_one_line_naming_the_file_and_line(tmp_path, capsys, text, message):
    pytest.importorskip("matplotlib")  # plot checks for it first
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {path}:"), err
    assert re.search(message, err), err
    assert not (tmp_path / "curves.png").exists()


def test_what_a_run_writes_still_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    records = [*GOOD, '{"step": 5, "loss": NaN, "lr": Infinity, "note": "text", "mfu": null}', '{"step": 6, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(records))  # the last line cut by a kill: no newline
    assert main(["plot", str(tmp_path)]) == 0, capsys.readouterr().err
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_infinities_are_gaps_and_values_near_the_float_limit_do_not_break_the_axes(tmp_path, capsys):
    plt = pytest.importorskip("matplotlib.pyplot")
    records = [
        '{"step": 1, "loss": 5.0, "tokens_per_s": 1000.0, "lr": 1e308}',
        '{"step": 2, "loss": Infinity, "tokens_per_s": -1e308, "lr": -1e308, "mfu": 1e307}',  # MFU drawn ×100: inf
        '{"step": 3, "loss": -Infinity, "tokens_per_s": 1e308, "mfu": 1e308}',
        '{"step": 4, "loss": 1e308, "tokens_per_s": 2000.0}',
        '{"step": 5, "loss": -1e308, "tokens_per_s": 3000.0}',
        '{"step": 6, "loss": 2.0, "tokens_per_s": 4000.0}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(records) + "\n")
    curves = run_curves(RunDir(tmp_path)).curves
    assert [(step, value) for step, value in curves["loss"] if not math.isnan(value)] == [(1, 5.0), (6, 2.0)]
    assert [step for step, value in curves["tokens_per_s"] if not math.isnan(value)] == [1, 4, 5, 6]
    assert main(["plot", str(tmp_path)]) == 0, capsys.readouterr().err
    # lr and MFU hold nothing but gaps: two panels (loss, tokens/s) on one row of two
    assert plt.imread(tmp_path / "curves.png").shape[:2] == (400, 1100)


def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text("\n".join(GOOD) + "\n")
    out = tmp_path / "metrics.jsonl" / "curves.png"
    assert main(["plot", str(tmp_path), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"error: cannot write {out} (File exists: {tmp_path / 'metrics.jsonl'}); " \
        "give -o a path you can write\n"


def test_a_fifo_or_a_link_to_dev_zero_as_metrics_is_one_line_never_a_hang(tmp_path, capsys):
    """In a fresh process with a time limit: a blocked read fails the test after 60 s instead of hanging it. The file
    is streamed (no size cap: a long run's is large), so a line past LINE_LIMIT is named too, in bounded memory."""
    kinds = {"fifo": (os.mkfifo, "a FIFO"), "zero": (lambda p: p.symlink_to("/dev/zero"), "a character device")}
    for name, (make, kind) in kinds.items():
        metrics = tmp_path / name / "metrics.jsonl"
        metrics.parent.mkdir()
        make(metrics)
        result = run_cli("plot", str(metrics.parent), timeout=60)
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert result.stderr == f"error: {metrics}: cannot read it ({kind}, not a regular file)\n"
    long_line = tmp_path / "long" / "metrics.jsonl"
    long_line.parent.mkdir()
    long_line.write_text("\n".join(GOOD[:2]) + "\n" + '{"step": 3, "loss": 1.0, "x": "' + "x" * LINE_LIMIT + '"}\n')
    assert main(["plot", str(long_line.parent)]) == 2
    assert capsys.readouterr().err == f"error: {long_line}:3: longer than {LINE_LIMIT:,} bytes; metrics.jsonl holds " \
        "one JSON object per line, a few hundred bytes each\n"
