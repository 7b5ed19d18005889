"""Shards and the readers of files that this module parses itself: jsonl, text, csv and json.

A shard knows its record count without reading the records and reads any range `[start, stop)` of them in
order, yielding `(index in the shard, record, location)`. Line-based files (jsonl, text lines and paragraphs,
csv) get a sparse index, cached by path, size and mtime. Parquet, Arrow and `datasets` tables are read by
`clustertrain.data.columnar`; `clustertrain.data.sources` picks the reader of each format.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import stat
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from clustertrain.errors import DataError
from clustertrain.files import json_error, json_object, json_type, write_atomic

INDEX_EVERY = 1024  # a line index notes every 1024th record: a seek costs at most 1023 record skips
BOM = b"\xef\xbb\xbf"

Row = tuple[int, dict, str]  # index in the shard, record, location for messages


class BadData:
    """The `on_bad_data` policy: raise a DataError, or count the reason and go on."""

    def __init__(self, on_bad_data: str) -> None:
        if on_bad_data not in ("error", "skip"):
            raise ValueError(f"on_bad_data must be 'error' or 'skip', not {on_bad_data!r}")
        self.skip = on_bad_data == "skip"
        self.skipped: Counter[str] = Counter()

    def report(self, reason: str, message: str) -> None:
        """Raise `message` as a DataError, or count `reason` when skipping."""
        if not self.skip:
            raise DataError(message)
        self.skipped[reason] += 1


class Shard(Protocol):
    count: int

    def read(self, start: int, stop: int) -> Iterator[Row]: ...


def special_kind(path: Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a directory ("a FIFO", "a character
    device", ...), following symbolic links; None otherwise. Reading one could block forever or never end."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), None)


def decode(raw: bytes, offset: int, location: str, bad: BadData) -> str | None:
    """UTF-8 text of `raw` (found at byte `offset` of its file), or None after reporting it: bytes that are not
    UTF-8, or a NUL byte, which text never holds (UTF-8 would take a file of NULs for text)."""
    if offset == 0 and raw.startswith(BOM):
        raw, offset = raw[len(BOM):], len(BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad.report("not UTF-8", f"{location}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {offset + e.start})")
        return None
    if (nul := raw.find(b"\0")) >= 0:
        bad.report("binary data", f"{location}: binary data, not UTF-8 text (a NUL byte at offset {offset + nul})")
        return None
    return text


def check_text(text: str, what: str) -> str:
    """`text`, if it is Unicode text a tokenizer takes; a DataError naming `what` for a lone surrogate, which a
    JSON `\\ud800` escape can make and no UTF-8 encoder (so no tokenizer) accepts."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{what} holds a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}, which is "
                            "not text (half of a \\u escaped pair?)") from None
    return text


def parse_object(text: str, location: str, bad: BadData) -> dict | None:
    """The JSON object in `text`, or None after reporting why there is none (files.json_object)."""
    try:
        return json_object(text)
    except ValueError as e:  # "malformed JSON (...)", "not a JSON object (...)": its reason, then its detail
        bad.report(str(e).split(" (")[0], f"{location}: {e}")
        return None


# Line-based files: jsonl and text lines (a record per non-blank line), text paragraphs (a record per run of
# non-blank lines).


def scan_records(path: Path, kind: str) -> tuple[int, np.ndarray]:
    """Count the records of a line-based file of `kind` (see `_records`); note (byte offset, line number) of
    every INDEX_EVERY-th."""
    marks: list[tuple[int, int]] = []
    count = 0
    with open(path, "rb") as f:
        for line_no, offset, _ in _records(f, 0, 1, kind):
            if count % INDEX_EVERY == 0:
                marks.append((offset, line_no))
            count += 1
    return count, np.array(marks, dtype=np.int64).reshape(-1, 2)


def load_index(path: Path, kind: str, cache_dir: Path) -> tuple[int, np.ndarray]:
    """`scan_records` of `path`, from cache_dir/index/ when this path, size and mtime were scanned before."""
    stat = path.stat()
    key = f"{kind}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{INDEX_EVERY}"
    file = cache_dir / "index" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"
    try:
        with np.load(file) as saved:
            return int(saved["count"]), saved["marks"]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        pass
    count, marks = scan_records(path, kind)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        saved = io.BytesIO()
        np.savez(saved, count=count, marks=marks)
        write_atomic(file, saved.getvalue())  # ranks scanning the same file at once never see half an index
    except OSError:
        pass  # a read-only cache only costs a rescan next time
    return count, marks


def _indexed_records(path: Path, marks: list, kind: str, start: int, stop: int,
                     header_rows: int = 0) -> Iterator[tuple[int, bytes, int, str]]:
    """(index, raw bytes, byte offset, "file:line") of records `start` to `stop` - 1, read from the index mark
    nearest before `start`; the first `header_rows` records (a CSV header) are not counted."""
    first = start + header_rows
    offset, line_no = (int(x) for x in marks[first // INDEX_EVERY])
    index = first - first % INDEX_EVERY - header_rows
    with open(path, "rb") as f:
        f.seek(offset)
        for start_line, first_offset, raw in _records(f, offset, line_no, kind):
            if index >= stop:
                return
            if index >= start:
                yield index, raw, first_offset, f"{path}:{start_line}"
            index += 1


def _records(f, offset: int, line_no: int, kind: str) -> Iterator[tuple[int, int, bytes]]:
    """(first line number, byte offset, bytes) of each record from the current position, a record start: a
    non-blank line (`lines`), a run of non-blank lines (`blocks`), or a CSV row, whose quoted fields may hold
    line breaks (`csv`: lines until an even number of quotes, as doubled quotes keep the parity)."""
    record: list[bytes] = []
    start_line = first_offset = quotes = 0
    for line in f:
        if kind == "csv" and record:  # an open quoted field: the row goes on, blank lines included
            record.append(line)
        elif line.strip():
            if not record:
                start_line, first_offset = line_no, offset
            record.append(line)
        elif record:  # a blank line ends a block
            yield start_line, first_offset, b"".join(record)
            record = []
        quotes += line.count(b'"') if record and kind == "csv" else 0
        if record and kind != "blocks" and not quotes % 2:
            yield start_line, first_offset, b"".join(record)
            record, quotes = [], 0
        offset += len(line)
        line_no += 1
    if record:
        yield start_line, first_offset, b"".join(record)


def check_json_lines(path: Path) -> None:
    """A DataError naming the first line of JSON-lines file `path` that is not a JSON object (UTF-8 text), for
    readers that do not say where (Arrow's); a file holding one JSON array is parsed whole instead."""
    bad = BadData("error")
    with open(path, "rb") as f:
        if f.read(len(BOM) + 64).removeprefix(BOM).lstrip().startswith(b"["):
            _load_json(path, bad)
            return
        f.seek(0)
        for line_no, offset, raw in _records(f, 0, 1, "lines"):
            text = decode(raw, offset, f"{path}:{line_no}", bad)
            parse_object(text, f"{path}:{line_no}", bad)


class LineRecords:
    """A line-based file read through its sparse index: a JSON object per line (`unit="json"`, jsonl), or text
    with a document per blank-line-separated paragraph or per line."""

    def __init__(self, path: Path, *, unit: str, cache_dir: Path, bad: BadData) -> None:
        self.path, self.unit, self.bad = path, unit, bad
        self.kind = "blocks" if unit == "paragraph" else "lines"
        self.count, self.marks = load_index(path, self.kind, cache_dir)

    def read(self, start: int, stop: int) -> Iterator[Row]:
        for index, raw, offset, location in _indexed_records(self.path, self.marks, self.kind, start, stop):
            record = self._parse(raw, offset, location)
            if record is not None:
                yield index, record, location

    def _parse(self, raw: bytes, offset: int, location: str) -> dict | None:
        text = decode(raw, offset, location, self.bad)
        if text is None:
            return None
        if self.unit == "json":
            return parse_object(text, location, self.bad)
        return {"text": text.rstrip("\r\n")}


class CsvRecords:
    """A CSV file whose first row names the columns: a record per later row, read through its sparse index."""

    def __init__(self, path: Path, header: list[str], count: int, marks: np.ndarray, bad: BadData) -> None:
        self.path, self.header, self.count, self.marks, self.bad = path, header, count, marks, bad

    @classmethod
    def open(cls, path: Path, *, cache_dir: Path, bad: BadData) -> CsvRecords | None:
        count, marks = load_index(path, "csv", cache_dir)
        with open(path, "rb") as f:
            first = next(_records(f, 0, 1, "csv"), None)
        text = None if first is None else decode(first[2], 0, f"{path}:1", bad)
        if text is None:
            return None
        header = _csv_row(text, f"{path}:1", bad)
        if header is None:
            return None
        if len(set(header)) < len(header) or not all(header):
            bad.report("bad CSV header", f"{path}:1: the header row names columns {header}: each must be named once")
            return None
        return cls(path, header, count - 1, marks, bad)

    def read(self, start: int, stop: int) -> Iterator[Row]:
        for index, raw, offset, location in _indexed_records(self.path, self.marks, "csv", start, stop, header_rows=1):
            text = decode(raw, offset, location, self.bad)
            row = None if text is None else _csv_row(text, location, self.bad)
            if row is not None and len(row) != len(self.header):
                self.bad.report("bad CSV row", f"{location}: {len(row)} fields, but the header names "
                                               f"{len(self.header)} ({', '.join(self.header)})")
            elif row is not None:
                yield index, dict(zip(self.header, row)), location


def _csv_row(text: str, location: str, bad: BadData) -> list[str] | None:
    """The fields of one CSV row, or None after reporting why it is not one."""
    try:
        return next(csv.reader([text.rstrip("\r\n")], strict=True), [])
    except csv.Error as e:  # a quoted field never closed, a quote inside an unquoted one
        bad.report("bad CSV row", f"{location}: not a CSV row ({e})")
        return None


class TextFiles:
    """Whole files as documents: .txt in file mode, or the stdlib corpus (`lenient`: a byte budget, no checks)."""

    def __init__(self, files: list[tuple[Path, int]], bad: BadData, lenient: bool = False) -> None:
        self.files, self.bad, self.lenient = files, bad, lenient  # (path, bytes to read or -1 for all)
        self.count = len(files)

    def read(self, start: int, stop: int) -> Iterator[Row]:
        for index in range(start, min(stop, self.count)):
            path, limit = self.files[index]
            try:
                with open(path, "rb") as f:
                    raw = f.read(limit)
            except OSError as e:
                raise DataError(f"cannot read {path}: {e.strerror}") from None
            if self.lenient:
                text: str | None = raw.decode("utf-8", errors="replace")
                if not text.strip():
                    continue
            else:
                text = decode(raw, 0, str(path), self.bad)
                if text is not None and not text.strip():
                    self.bad.report("empty file", f"{path}: empty file")
                    continue
            if text is not None:
                yield index, {"text": text}, str(path)


class JsonFile:
    """A .json file holding a list of records, or an object whose one value is that list.

    It is parsed whole, at open to count and again at each read: .json files are small by nature (use
    jsonl for large data).
    """

    def __init__(self, path: Path, count: int, bad: BadData) -> None:
        self.path, self.count, self.bad = path, count, bad

    @classmethod
    def open(cls, path: Path, bad: BadData) -> JsonFile | None:
        records = _load_json(path, bad)
        return None if records is None else cls(path, len(records), bad)

    def read(self, start: int, stop: int) -> Iterator[Row]:
        records = _load_json(self.path, self.bad) or []
        for index in range(start, min(stop, len(records))):
            location = f"{self.path} record {index}"
            if isinstance(records[index], dict):
                yield index, records[index], location
            else:
                self.bad.report("not a JSON object", f"{location}: not a JSON object (got {json_type(records[index])})")


def _load_json(path: Path, bad: BadData) -> list | None:
    """The records of a .json file, or None after reporting why it holds none."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    text = decode(raw, 0, str(path), bad)
    if text is None or not text.strip():
        return None if text is None else []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        bad.report("malformed JSON", f"{path}:{e.lineno}: malformed JSON ({json_error(e)})")
        return None
    except (RecursionError, ValueError) as e:
        bad.report("malformed JSON", f"{path}: malformed JSON ({json_error(e)})")
        return None
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list):
        value = next(iter(value.values()))
    if not isinstance(value, list):
        bad.report("not a list of records", f"{path}: expected a list of records, or an object holding one")
        return None
    return value
