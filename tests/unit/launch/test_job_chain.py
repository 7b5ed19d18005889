"""`clustertrain slurm status` on a run's files, in-process through the CLI's main(): a hostile job chain
(slurm/jobs.jsonl) is exit 2 and one `error:` line naming the file and line; the files' own text is shown as it is."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from clustertrain.cli import main

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
