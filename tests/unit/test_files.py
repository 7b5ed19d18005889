"""clustertrain.files.write_atomic: a reader sees the old file or the new one, and a failed write leaves no trace."""

from __future__ import annotations

import errno
import threading

import pytest

from clustertrain import files
from clustertrain.files import write_atomic


@pytest.mark.parametrize("durable", [False, True])
def test_a_write_replaces_the_file_whole(tmp_path, durable):
    path = tmp_path / "state.json"
    write_atomic(path, "old", durable=durable)
    write_atomic(path, b"new bytes", durable=durable)
    assert path.read_bytes() == b"new bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_atomic(path, "old")

    class FullDisk:
        def __init__(self, file, mode):
            self.file = open(file, mode)  # created, as a full disk still lets it be

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "open", FullDisk, raising=False)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_threads_writing_one_file_never_fail(tmp_path):
    """A rank's watchdog thread and main thread both write its heartbeat: neither may rename the other's temporary."""
    path = tmp_path / "rank-00001.json"
    errors = []

    def write(label):
        try:
            for i in range(300):
                write_atomic(path, f"{label} {i}")
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(label,)) for label in ("main", "watchdog", "third")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_text().split()[1] == "299"
    assert [p.name for p in tmp_path.iterdir()] == ["rank-00001.json"]
