"""Files written so that no reader, and no crash, ever sees half of one: the package's one atomic write; and
the one open of a file someone else may have replaced (a run's status, heartbeats, hang report, metrics): regular
files only, never blocking, read whole up to a bound (`read_regular`) or streamed (`open_regular`)."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO

HOST = socket.gethostname()
READ_LIMIT = 1 << 20  # bytes: a run's own JSON and stack files are kilobytes; past this a file is not one of them
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def write_atomic(path: Path, data: str | bytes, durable: bool = False) -> None:
    """Write `data` to `path` through a temporary sibling renamed over it: a reader sees the old file or the new
    one, never part of either. `durable`: flushed to disk before the rename (a checkpoint's files, which must
    survive a node crash). The temporary name is this thread's own, on this host (a rank's watchdog thread and
    main thread both write its heartbeat; ranks on several nodes may share a pid), so writers of one file never
    mix; it is removed if the write fails."""
    tmp = path.with_name(f".{path.name}.tmp-{HOST}-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_regular(path: Path, limit: int = READ_LIMIT) -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes. Never blocks and never reads more than
    `limit` + 1 bytes: a FIFO, a device (a link to /dev/zero), a directory or a symlink loop is refused before it
    is opened, and it is opened non-blocking, so that one swapped in between the check and the open cannot block.

    Raises:
        FileNotFoundError: `path` does not exist.
        OSError: Anything else; its `strerror` says what in a few words ("a FIFO, not a regular file", "larger
            than 1,048,576 bytes", "Too many levels of symbolic links", "Permission denied").
    """
    chunks, size = [], 0
    with open_regular(path, limit) as f:
        while size <= limit and (chunk := f.read(limit + 1 - size)):  # a file still growing stops here too
            chunks.append(chunk)
            size += len(chunk)
    if size > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes", str(path))
    return b"".join(chunks)


def open_regular(path: Path, limit: int | None = None) -> BinaryIO:
    """`path` opened for reading in binary if it is a regular file (of at most `limit` bytes when given), for a
    file read as a stream (metrics.jsonl, legitimately large). Refuses what `read_regular` refuses, as it does.

    Raises:
        FileNotFoundError, OSError: As `read_regular`.
    """
    _check_regular(os.stat(path), path, limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check_regular(os.fstat(fd), path, limit)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json_object(path: Path, limit: int = READ_LIMIT) -> dict[str, Any]:
    """The JSON object in `path`, read by `read_regular`.

    Raises:
        FileNotFoundError, OSError: As `read_regular`.
        ValueError: Not UTF-8 JSON, or not an object; the message says which ("not valid JSON (Expecting value
            at line 1 column 31)", "not a JSON object (got a list)").
    """
    data = read_regular(path, limit)
    try:
        value = json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # not UTF-8; nesting past the recursion limit; a 4,300-digit number
        raise ValueError(f"not valid JSON ({'nested too deeply' if isinstance(e, RecursionError) else e})") from None
    if not isinstance(value, dict):
        got = "null" if value is None else "a list" if isinstance(value, list) else f"a {type(value).__name__}"
        raise ValueError(f"not a JSON object (got {got})")
    return value


def _check_regular(st: os.stat_result, path: Path, limit: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((f"{name}, " for test, name in _NOT_REGULAR if test(st.st_mode)), "")
        raise OSError(errno.EINVAL, f"{kind}not a regular file", str(path))
    if limit is not None and st.st_size > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes ({st.st_size:,})", str(path))
