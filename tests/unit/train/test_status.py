"""status.json is written whatever the failure: on a full disk a run's "failed" still replaces its "running"."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from clustertrain.run_dir import RunDir
from clustertrain.train.status import STATUS_FILE, read_status, write_status

def fill_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on new files get no bytes, as on a full disk: the atomic write's temporary file is created, its
    write fails with ENOSPC. (Rewriting the bytes of a file that has them needs no new block: that still works.)"""

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        opened = open(file, mode, *args, **kwargs)
        if "w" in mode:
            opened.close()
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return opened

    monkeypatch.setattr("clustertrain.files.open", open_on_a_full_disk, raising=False)


def test_a_full_disk_still_records_failed_and_leaves_no_tmp(tmp_path, monkeypatch):
    write_status(RunDir(tmp_path), "running", step=3, total_steps=10)
    with monkeypatch.context() as full:
        fill_disk(full)
        full.setattr("clustertrain.train.status.time.time", lambda: 1.0)
        error = "CheckpointError: checkpoints/step-0000004 could not be written: [Errno 28] No space left on device"
        write_status(RunDir(tmp_path), "failed", step=4, error=error)
    status = read_status(RunDir(tmp_path))
    assert (status["state"], status["step"], status["error"], status["time"]) == ("failed", 4, error, 1.0)
    assert "total_steps" not in status  # the record is rewritten whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATUS_FILE]
    write_status(RunDir(tmp_path), "running", step=4)  # room again: the atomic way
    assert read_status(RunDir(tmp_path))["state"] == "running"
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATUS_FILE]


def test_a_shorter_record_in_place_leaves_nothing_of_the_longer_one(tmp_path, monkeypatch):
    write_status(RunDir(tmp_path), "running", note="x" * 2000)
    fill_disk(monkeypatch)
    write_status(RunDir(tmp_path), "failed")
    assert json.loads((tmp_path / STATUS_FILE).read_text())["state"] == "failed"  # no old bytes after the record


def test_a_full_disk_with_no_status_yet_raises_and_leaves_no_tmp(tmp_path, monkeypatch):
    fill_disk(monkeypatch)
    with pytest.raises(OSError) as raised:
        write_status(RunDir(tmp_path), "running", step=0)
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_real_full_filesystem(tmp_path):
    """A 64 KiB tmpfs filled to the last byte, in a user and mount namespace of its own (skipped where unprivileged
    namespaces are not allowed)."""
    script = textwrap.dedent(f"""
        import errno, sys
        from pathlib import Path
        from clustertrain.run_dir import RunDir
        from clustertrain.train.status import read_status, write_status
        run = Path({str(tmp_path / "mnt")!r})
        write_status(RunDir(run), "running", step=3)
        with open(run / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
        try:
            with open(run / "probe", "wb", buffering=0) as f:
                f.write(b"x")
            sys.exit("the filesystem is not full")
        except OSError:
            (run / "probe").unlink(missing_ok=True)
        write_status(RunDir(run), "failed", step=4, error="CheckpointError: " + "no space left " * 20)
        print(sorted(p.name for p in run.iterdir()), read_status(RunDir(run))["state"])
    """)
    (tmp_path / "mnt").mkdir()
    mount = f"mount -t tmpfs -o size=64k tmpfs {tmp_path / 'mnt'} && exec {sys.executable} -c \"$0\""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs tmpfs {tmp_path / 'mnt'}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged tmpfs mount here: {probe.stderr.decode().strip()[:200]}")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", mount, script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "['filler', 'status.json'] failed"


@pytest.mark.parametrize("text", ["[1, 2]", '"failed"', "{}", '{"state": 3}', "{" * 100000, "\xff"])
def test_a_status_that_is_no_status_reads_as_none(tmp_path, text):
    (tmp_path / STATUS_FILE).write_text(text, encoding="latin-1")
    assert read_status(RunDir(tmp_path)) is None
    (tmp_path / STATUS_FILE).write_text(json.dumps({"state": "finished"}))
    assert read_status(RunDir(tmp_path)) == {"state": "finished"}
