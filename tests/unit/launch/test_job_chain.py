"""`clustertrain slurm status` on a run's files, in-process through the CLI's main(): a hostile job chain
(slurm/jobs.jsonl) is exit 2 and one `error:` line naming the file and line; the files' own text is shown as it is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import unicodedata

import pytest
from helpers import run_cli

from clustertrain.cli import main
from clustertrain.launch import jobs
from clustertrain.launch.jobs import job_states

CHAIN = [
    {"event": "submitted", "time": 1.7e9, "job_id": "7", "script": "/runs/a/slurm/job.sh"},
    {"event": "started", "time": 1.7e9 + 60, "job_id": "7", "restart": 0, "nodes": "node[01-02]"},
    {"event": "ended", "time": 1.7e9 + 600, "job_id": "7", "restart": 0, "exit_code": 74, "signalled": False,
     "outcome": "failed"},
]


def chain_with(bad: str, at: int = 2) -> str:
    """The good chain with line `at` replaced by `bad`."""
    lines = [json.dumps(event) for event in CHAIN]
    lines[at - 1] = bad
    return "".join(line + "\n" for line in lines)


BAD = {
    "not JSON": (chain_with("started 7"), r"2: malformed JSON \(Expecting value at column 1\)"),
    "an array": (chain_with('["started", "7"]'), r"2: not a JSON object \(got array\)"),
    "a string": (chain_with('"started"'), r"2: not a JSON object \(got string\)"),
    "nested too deeply": (chain_with("{\"a\": " * 50_000), r"2: malformed JSON \(nested too deeply\)"),
    "not UTF-8": (chain_with('{"event": "started", "job_id": "\udcff"}'), r"2: not UTF-8 text \(byte 0xff"),
    "no event": (chain_with('{"job_id": "7"}'), r"2: no 'event'; every event of the Slurm job chain names"),
    "no job id": (chain_with('{"event": "started"}'), r"2: no 'job_id'"),
    "a job id that is a number": (chain_with('{"event": "started", "job_id": 7}'),
                                  r"2: 'job_id' is number 7; it must be a string"),
    "an event that is null": (chain_with('{"event": null, "job_id": "7"}'), r"2: 'event' is null; it must be a string"),
    "a time that is a string": (chain_with('{"event": "started", "job_id": "7", "time": "noon"}'),
                                r"2: 'time' is string \"noon\"; it must be a number"),
    "a restart that is true": (chain_with('{"event": "started", "job_id": "7", "restart": true}'),
                               r"2: 'restart' is boolean true; it must be a whole number"),
    "nodes that are a list": (chain_with('{"event": "started", "job_id": "7", "nodes": ["n1"]}'),
                              r"2: 'nodes' is array \[\"n1\"\]; it must be a string or null"),
    "an exit code that is a float": (chain_with('{"event": "ended", "job_id": "7", "exit_code": 1.5}', at=3),
                                     r"3: 'exit_code' is number 1.5;"),
}


@pytest.mark.parametrize("text, message", BAD.values(), ids=BAD.keys())
def test_a_bad_job_chain_is_one_line_naming_the_file_and_line(tmp_path, capsys, text, message):
    path = tmp_path / "slurm" / "jobs.jsonl"
    path.parent.mkdir()
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert main(["slurm", "status", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith(f"error: {path}:"), captured.err
    assert re.search(message, captured.err), captured.err
    assert captured.out == ""


def test_status_shows_the_files_own_text_as_it_is(tmp_path, capsys):
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "jobs.jsonl").write_text("".join(json.dumps(event) + "\n" for event in CHAIN))
    error = "CheckpointError: [/scratch/a] is full [bold]"  # rich markup would raise on the closing tag
    (tmp_path / "status.json").write_text(json.dumps(
        {"state": "failed", "time": float("nan"), "step": 4, "total_steps": 10, "error": error}))
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 4, "loss": 2.5, "tokens": float("nan"), "tokens_per_s": 1000.0}) + "\n")
    assert main(["slurm", "status", str(tmp_path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"state failed at step 4/10 ({error}), ?\n" in out
    assert "node[01-02]" in out and "failed" in out
    assert "progress step 4/10 (40%), loss 2.5000\n" in out
    assert f"log tail -f {tmp_path / 'slurm' / '7.out'}\n" in out


def test_the_job_steps_of_a_slurm_script_import_no_torch():
    """job-start and job-end run in every job, around the ranks: importing torch would add seconds to each, and
    to the moment Slurm marks the job ended after job-end has recorded it."""
    code = ("import sys; from clustertrain.cli import slurm_cmd; from clustertrain.launch import jobs; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


ESCAPES = "\x1b[2J\x1b]0;owned\x07\x9b31m\u202e"  # clear the screen, retitle the window, a C1 CSI, a bidi override


def test_status_escapes_what_a_terminal_would_obey_and_cuts_long_values(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # a wide terminal: rich would fit a long cell to 80 columns itself
    job = "7" + ESCAPES
    chain = [{**event, "job_id": job} for event in CHAIN]
    chain[1]["nodes"] = "node" + ESCAPES + "n" * (1 << 20)  # 1 MB: under the chain's size cap
    chain[2].update(outcome="failed" + ESCAPES, excluded="node9" + ESCAPES)
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "jobs.jsonl").write_text("".join(json.dumps(event) + "\n" for event in chain))
    error = "\n".join(f"line {i} {ESCAPES} " + "x" * 2000 for i in range(300))  # 600 KB
    (tmp_path / "status.json").write_text(json.dumps(
        {"state": "failed" + ESCAPES, "step": 4, "total_steps": 10, "error": error}))
    assert main(["slurm", "status", str(tmp_path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    shown = [c for c in out if c != "\n" and (unicodedata.category(c) in ("Cc", "Cf") or c in "\u2028\u2029")]
    assert shown == [], shown
    seen = ESCAPES.encode("unicode-escape").decode()
    assert f"state failed{seen} at step 4/10 (line 0 {seen} xxx" in out and "line 1 " not in out  # the first line
    assert f"log tail -f {tmp_path / 'slurm' / ('7' + seen)}.out\n" in out
    assert f"node{seen}{'n' * 16}… " in out and f" 7{seen} " in out and f"node9{seen}" in out  # cells: 40 characters
    lines = out.splitlines()
    assert len(lines) < 20 and max(map(len, lines)) < 700, (len(lines), max(map(len, lines)))


def test_a_fifo_as_status_or_metrics_is_named_and_the_rest_shown(tmp_path):
    """In a fresh process with a time limit: a blocked read fails the test after 60 s instead of hanging it."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "jobs.jsonl").write_text("".join(json.dumps(event) + "\n" for event in CHAIN))
    for name in ("status.json", "metrics.jsonl"):
        os.mkfifo(tmp_path / name)
    result = run_cli("slurm", "status", str(tmp_path), timeout=60)
    assert (result.returncode, result.stderr) == (1, ""), result.stderr
    assert f"state unknown: {tmp_path / 'status.json'} is damaged (a FIFO, not a regular file)\n" in result.stdout
    assert f"progress unknown: {tmp_path / 'metrics.jsonl'}: cannot read it (a FIFO, not a regular file)\n" \
        in result.stdout
    assert "node[01-02]" in result.stdout and f"log tail -f {tmp_path / 'slurm' / '7.out'}\n" in result.stdout


def test_squeue_is_asked_only_about_ids_slurm_could_have_given(tmp_path, monkeypatch):
    """A tampered chain's job id (a 1 MB string, an option) never reaches squeue's command line: it failed with
    E2BIG there, or would be read as a flag."""
    asked = tmp_path / "asked"
    squeue = tmp_path / "bin" / "squeue"
    squeue.parent.mkdir()
    squeue.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {asked}\necho "7 RUNNING"\n')
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{squeue.parent}:{os.environ['PATH']}")
    assert job_states(["7", "8_2", "9+0", "x" * 1_000_000, "--all", "7;rm"]) == {"7": "RUNNING"}
    assert asked.read_text().split("\n")[:3] == ["-h", "-j", "7,8_2,9+0"]


def test_a_squeue_that_does_not_answer_leaves_the_recorded_states(tmp_path, monkeypatch):
    """A Slurm controller that is down or swamped never holds `status` or a job's end past the limit."""
    squeue = tmp_path / "bin" / "squeue"
    squeue.parent.mkdir()
    squeue.write_text("#!/bin/sh\nexec sleep 60\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{squeue.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(jobs, "SQUEUE_TIMEOUT_S", 0.5)
    started = time.monotonic()
    assert jobs.job_states(["7"]) == {}
    assert time.monotonic() - started < 5
