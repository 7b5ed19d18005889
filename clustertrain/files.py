"""Files written so that no reader, and no crash, ever sees half of one: the package's one atomic write; the one
open of a file someone else may have replaced (a run's status, heartbeats, hang report, metrics): regular files
only, never blocking, read whole up to a bound (`read_regular`) or streamed (`open_regular`); and the one reader and
writer of JSON lines (metrics.jsonl, the Slurm job chain), whose messages name the file and line."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, BinaryIO

from clustertrain.errors import DataError, first_line

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


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def json_value(value: Any) -> str:
    """A parsed JSON value for a message, as it was written: 'null', 'string "2"', 'array [1, 2]' (40 characters)."""
    return "null" if value is None else f"{json_type(value)} {json.dumps(value)[:40]}"


def json_error(error: Exception) -> str:
    """Why json.loads refused a text, in a few words: "Expecting value at column 1", "nested too deeply"."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg.removesuffix(' at')} at column {error.colno}"  # "Unterminated string starting at"
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return first_line(error).split(";")[0]  # "Exceeds the limit (4300 digits) for integer string conversion..."


def json_object(text: str) -> dict[str, Any]:
    """The JSON object in `text` (one line of a JSON-lines file).

    Raises:
        ValueError: "malformed JSON (Expecting value at column 1)", "not a JSON object (got array)".
    """
    try:
        value = json.loads(text)
    except (RecursionError, ValueError) as e:  # nesting past the recursion limit; an integer of 4,300+ digits
        raise ValueError(f"malformed JSON ({json_error(e)})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object (got {json_type(value)})")
    return value


def read_jsonl(path: Path, line_limit: int, file_limit: int | None = None, about: str = "",
               drop_cut_line: bool = False, check: Callable[[dict[str, Any]], None] | None = None
               ) -> list[dict[str, Any]]:
    """The JSON object on each non-blank line of `path`, streamed from a regular file (`open_regular`), so that a
    large file is read in bounded memory and a FIFO or a link to /dev/zero in its place neither blocks nor fills it.

    Args:
        line_limit: Bytes of one line; a longer line is refused.
        file_limit: Bytes of the whole file, when it has a bound.
        about: What the file holds, added to a message about a line that is no JSON object of it.
        drop_cut_line: A last line cut short (its writer killed mid-write: no newline at its end) that is not
            whole is dropped rather than refused.
        check: Called with each object; a ValueError it raises is reported as that line's problem.

    Raises:
        DataError: One line naming the file (not a regular file, too large) or the file and line (longer than
            `line_limit`, not UTF-8, not JSON, not an object, refused by `check`).
    """
    try:
        with open_regular(path, file_limit) as f:
            return _json_lines(f, path, line_limit, file_limit, about, drop_cut_line, check)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None


def _json_lines(f: IO[bytes], path: Path, line_limit: int, file_limit: int | None, about: str,
                drop_cut_line: bool, check: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    records, size, also = [], 0, f"; {about}" if about else ""
    for number, line in enumerate(iter(lambda: f.readline(line_limit + 1), b""), start=1):
        where, size = f"{path}:{number}", size + len(line)
        if file_limit is not None and size > file_limit:  # a file still growing stops here
            raise OSError(errno.EFBIG, f"larger than {file_limit:,} bytes", str(path))
        if len(line) > line_limit:
            raise DataError(f"{where}: longer than {line_limit:,} bytes{also}")
        if not line.strip():
            continue
        cut = drop_cut_line and not line.endswith(b"\n")  # only the last line can lack its newline
        try:
            record = json_object(line.removesuffix(b"\n").removesuffix(b"\r").decode("utf-8"))
        except UnicodeDecodeError as e:
            if cut:
                break
            raise DataError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at column {e.start + 1}){also}") \
                from None
        except ValueError as e:
            if cut:
                break
            raise DataError(f"{where}: {e}") from None
        if check is not None:
            try:
                check(record)
            except ValueError as e:
                raise DataError(f"{where}: {e}") from None
        records.append(record)
    return records


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append `record` to `path` as one JSON line, its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class JsonlWriter:
    """Appends JSON objects to `path` (created if missing), one per line, each flushed as it is written. A last line
    that a killed writer left without its newline is cut off first, so the file stays one object per line when a
    resumed run appends to it."""

    def __init__(self, path: Path) -> None:
        if path.exists() and path.stat().st_size > 0:
            with path.open("r+b") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - (1 << 20)))
                tail = f.read()
                if not tail.endswith(b"\n"):
                    f.truncate(size - len(tail) + tail.rfind(b"\n") + 1)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        """Write `record` as one line, flushed."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; nothing more is written."""
        self._file.close()
