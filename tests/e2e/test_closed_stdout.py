"""Output is best-effort. `clustertrain train ... | head -4`: a reader that goes away never ends the run, which
trains to the end, saves, writes status.json `finished` and exits 0 (it was exit 1, no line, status.json left
"running"); a closed stderr does not change a user error's exit code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ONE_THREAD, TINY, kill_tree

from clustertrain.checkpoint.dcp import latest_checkpoint
from clustertrain.run_dir import RunDir
from clustertrain.train.status import read_status


@pytest.mark.dist  # trains
def test_a_reader_that_closes_after_four_lines_does_not_end_the_run(tmp_path):
    args = [f"--set={o}" for o in (*TINY, f"train.run_dir={tmp_path}", "train.steps=6")]
    proc = subprocess.Popen([sys.executable, "-m", "clustertrain", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **ONE_THREAD}, start_new_session=True)
    try:
        head = [proc.stdout.readline() for _ in range(4)]
        proc.stdout.close()  # as `head -4` exits
        stderr = proc.communicate(timeout=300)[1].decode()
    finally:
        if proc.poll() is None:  # timed out (or the test broke off): leave nothing running
            kill_tree(proc.pid)
    assert all(head), head  # the reader did get its lines
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    status = read_status(RunDir(tmp_path))
    assert (status["state"], status["step"]) == ("finished", 6), status
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-0000006"


def test_a_closed_stderr_keeps_a_user_error_s_exit_code(tmp_path, monkeypatch):
    from clustertrain.cli import main

    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w", buffering=1) as stderr:  # line-buffered, as sys.stderr is
        monkeypatch.setattr("sys.stderr", stderr)
        assert main(["config", "show", str(tmp_path / "missing.yaml")]) == 2
        monkeypatch.undo()
        assert os.path.samestat(os.fstat(stderr.fileno()), os.stat(os.devnull))
