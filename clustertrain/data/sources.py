"""Where documents come from: local files of several formats, HF datasets, and the standard library.

A source is index-addressable: `len(source)` comes from file metadata or a cached index, and
`source.read(start, stop)` starts at any document in O(shards) plus a bounded skip, so the loader can
split a source into ranges and resume each at an arbitrary document. Nothing reads a whole file into
memory except .json files (small by nature) and .txt files in `text_unit: file` mode (the file is the
document).

    source = open_source(SourceConfig(path="data/*.jsonl"), cache_dir=Path("~/.cache/clustertrain"))
    for doc in source.read(5000, 5003):
        print(doc.location, text_of(doc, "text")[:40])

Document indices count every record the files hold, bad ones included, so they stay stable whether
bad records are skipped or fixed. Whitespace-only lines of jsonl files are not records: they take no
index and are never reported. An empty file (no records) is reported at open and takes no index,
except a non-empty but whitespace-only .txt in file mode, found when read. Locations name 1-based lines (`a.jsonl:17`) and 0-based rows
(`a.parquet row 5`, `a.json record 5`).
"""

from __future__ import annotations

import glob
import os
import sysconfig
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from clustertrain.config.data_schema import FILE_FORMATS, SourceConfig
from clustertrain.data import columnar, readers, staged
from clustertrain.data.readers import BadData, Row, Shard, check_text, special_kind
from clustertrain.errors import DataError
from clustertrain.files import json_type


@dataclass(frozen=True)
class FileFormat:
    """The extensions that tell a file format, and `open(path, text_unit, cache_dir, bad)`: a file's shard, or
    None after reporting why it holds none (None for token ids, which are not documents)."""

    extensions: tuple[str, ...]
    open: Callable[[Path, str, Path, BadData], Shard | None] | None


FILE_READERS = {
    "text": FileFormat((".txt",), lambda path, unit, cache, bad: readers.LineRecords(
        path, unit=unit, cache_dir=cache, bad=bad)),
    "jsonl": FileFormat((".jsonl", ".ndjson"), lambda path, _, cache, bad: readers.LineRecords(
        path, unit="json", cache_dir=cache, bad=bad)),
    "json": FileFormat((".json",), lambda path, _, __, bad: readers.JsonFile.open(path, bad)),
    "csv": FileFormat((".csv",), lambda path, _, cache, bad: readers.CsvRecords.open(path, cache_dir=cache, bad=bad)),
    "parquet": FileFormat((".parquet",), lambda path, _, __, bad: columnar.ParquetFile.open(path, bad)),
    "arrow": FileFormat((".arrow",), lambda path, _, __, bad: columnar.ArrowFile.open(path, bad)),
    "tokens": FileFormat((".npy", ".bin"), None),  # read by clustertrain.data.tokens
}
assert tuple(FILE_READERS) == FILE_FORMATS, "FILE_READERS must cover exactly the schema's FILE_FORMATS"
EXTENSIONS = {extension: fmt for fmt, file_format in FILE_READERS.items() for extension in file_format.extensions}


@dataclass(frozen=True)
class Document:
    """One record of a source.

    Attributes:
        index: 0-based position in the source, stable for the same files.
        record: `{"text": ...}` for text and stdlib sources, the whole record for the others.
        location: where it is, for messages: `data/a.jsonl:17` or `data/a.parquet row 5`.
    """

    index: int
    record: dict
    location: str


class Source:
    """The documents of one configured source, across its shards, addressable by index.

    A read that ends inside a shard parks the shard's reader, so the read that starts where it stopped
    goes on without reopening or skipping (streams read consecutive windows); up to PARKED readers are
    kept, one per stream sharing the source. Not thread-safe.

    Attributes:
        label: the source's name in logs (`SourceConfig.label`).
        format: the resolved format (`auto` decided); text and stdlib records hold their text in "text".
        skipped: reason -> count of records skipped under `on_bad_data: skip`.
    """

    PARKED = 16

    def __init__(self, label: str, fmt: str, shards: list[Shard], bad: BadData) -> None:
        self.label, self.format = label, fmt
        self.skipped = bad.skipped
        self._shards = shards
        self._starts = list(accumulate((shard.count for shard in shards), initial=0))
        self._parked: OrderedDict[int, tuple[int, Generator[Row, None, None], Row]] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_parked": OrderedDict()}  # open readers stay with their process

    def __len__(self) -> int:
        return self._starts[-1]

    def __repr__(self) -> str:
        return f"Source({self.label!r}, {len(self)} documents in {len(self._shards)} shards)"

    def read(self, start: int, stop: int) -> Iterator[Document]:
        """The documents with indices in [start, stop), in order, without the skipped ones."""
        start, stop = max(start, 0), min(stop, len(self))
        if self._pid != os.getpid():  # a forked worker must not share its parent's file positions
            self._parked, self._pid = OrderedDict(), os.getpid()
        while start < stop:
            if start in self._parked:
                shard, rows, row = self._parked.pop(start)
            else:
                shard = bisect_right(self._starts, start) - 1
                rows, row = self._shards[shard].read(start - self._starts[shard], self._shards[shard].count), None
            base, end = self._starts[shard], self._starts[shard + 1]
            limit = min(stop, end)
            while (row := row or next(rows, None)) is not None and base + row[0] < limit:
                yield Document(base + row[0], row[1], row[2])
                row = None
            if row is not None:
                self._park(limit, shard, rows, row)
            start = limit

    def _park(self, start: int, shard: int, rows: Generator[Row, None, None], row: Row) -> None:
        self._parked[start] = (shard, rows, row)
        if len(self._parked) > self.PARKED:
            _, (_, oldest, _) = self._parked.popitem(last=False)
            oldest.close()


def open_source(source: SourceConfig, *, on_bad_data: str = "error", cache_dir: Path) -> Source:
    """Open a configured source; empty or unreadable files are reported here, bad records when read.

    Args:
        source: the source's config section.
        on_bad_data: "error" raises a DataError naming the file and line or row; "skip" counts the
            reason in `Source.skipped` and leaves the record out.
        cache_dir: the cache root; line indices of jsonl and text-block files go to `cache_dir/index/`.

    Raises:
        DataError: a missing path, an unreadable file or an uncached HF dataset.
        ValueError: for `tokens` sources, which are not documents.
    """
    bad = BadData(on_bad_data)
    fmt = source.format
    if fmt == "stdlib":
        shards: list[Shard] = [readers.TextFiles(_stdlib_budget(source.max_bytes), bad, lenient=True)]
    elif source.hf_name is not None or fmt == "hf":
        if source.hf_name is None:
            raise DataError(f"data source {source.path!r}: format hf reads hf_name, not a path (see hf_disk)")
        fmt = "hf"
        shards = [columnar.open_hf(source.hf_name, source.hf_config, source.split)]
    else:
        fmt, files = resolve_files(source.path or "", source.format)
        if fmt == "tokens":
            raise ValueError(f"data source {source.path!r}: token files are not documents; they are read elsewhere")
        if fmt == "hf_disk":
            shards = [columnar.open_hf_disk(files[0], source.split)]
        else:
            shards = open_files(fmt, files, text_unit=source.text_unit, cache_dir=Path(cache_dir).expanduser(), bad=bad)
    return Source(source.label, fmt, shards, bad)


def open_files(fmt: str, files: list[Path], *, text_unit: str, cache_dir: Path, bad: BadData) -> list[Shard]:
    """One shard per file (all of `text` in file mode share one), without the empty ones."""
    if fmt == "text" and text_unit == "file":
        kept = [(path, -1) for path in files if not _empty_on_disk(path, bad)]
        return [readers.TextFiles(kept, bad)] if kept else []
    file_format = FILE_READERS.get(fmt)
    if file_format is None or file_format.open is None:
        raise ValueError(f"no file reader for format {fmt!r}")
    shards: list[Shard] = []
    for path in files:
        if _empty_on_disk(path, bad):
            continue
        shard = file_format.open(path, text_unit, cache_dir, bad)
        if shard is not None and shard.count == 0:
            bad.report("empty file", f"{path}: empty file")
        elif shard is not None:
            shards.append(shard)
    return shards


def _empty_on_disk(path: Path, bad: BadData) -> bool:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if size == 0:
        bad.report("empty file", f"{path}: empty file")
    return size == 0


def text_of(doc: Document, field: str) -> str:
    """The string in `doc.record[field]`; a DataError naming the document when it is missing or not a string."""
    if field not in doc.record:
        fields = ", ".join(map(str, doc.record)) or "none"
        raise DataError(f"{doc.location}: record has no field '{field}' (fields: {fields})")
    value = doc.record[field]
    if not isinstance(value, str):
        raise DataError(f"{doc.location}: field '{field}' is {json_type(value)}, not a string")
    return check_text(value, f"{doc.location}: field '{field}'")


def resolve_files(pattern: str, fmt: str = "auto") -> tuple[str, list[Path]]:
    """The format and the sorted files of a path, a directory or a glob.

    A directory written by `save_to_disk` is one `hf_disk` source, and one written by `clustertrain stage
    dataset` the Parquet shards its manifest lists (a partial stage refused). Other directories are searched
    recursively for data files (hidden ones and unknown extensions left out); under `format: auto`
    their extensions must agree.
    """
    path = Path(pattern).expanduser()
    if path.is_dir() and fmt in ("auto", "parquet") and staged.is_staged(path):
        return "parquet", staged.staged_files(path)
    if path.is_dir():
        if fmt == "hf_disk" or (fmt == "auto" and _saved_dataset(path)):
            return "hf_disk", [path]
        found = (p for p in path.rglob("*") if not any(s.startswith(".") for s in p.relative_to(path).parts))
        files = sorted(p for p in found if _format_of(p) == fmt or (fmt == "auto" and _format_of(p)))
        files = regular_files(files, pattern)
        if not files:
            wanted = fmt if fmt != "auto" else "data"
            raise DataError(f"data source {pattern!r}: no {wanted} files ({', '.join(EXTENSIONS)}) in the directory")
    else:  # an existing path is itself, whatever glob would make of a [ or * in its name
        matches = [path] if path.exists() else sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        files = regular_files(matches, pattern)
        if not files:
            raise DataError(f"data source {pattern!r}: no such file, directory or matching files")
    if fmt == "hf_disk":
        raise DataError(f"data source {pattern!r}: hf_disk needs a directory written by save_to_disk")
    if fmt != "auto":
        return fmt, files
    formats = {_format_of(p) for p in files}
    if None in formats:
        unknown = next(p for p in files if _format_of(p) is None)
        raise DataError(f"{unknown}: cannot tell the format from the extension; set format ({', '.join(EXTENSIONS)})")
    if len(formats) > 1:
        mixed = " and ".join(sorted(formats))
        raise DataError(f"data source {pattern!r}: mixes {mixed} files; set format or narrow the glob")
    return formats.pop(), files


def regular_files(paths: list[Path], pattern: str) -> list[Path]:
    """The regular files among `paths` (directories left out); a DataError for a FIFO or a device, which would
    block a reader forever or never end (`/dev/zero`)."""
    for path in paths:
        if kind := special_kind(path):
            what = repr(pattern) if path == Path(pattern).expanduser() else f"{pattern!r}: {path}"
            raise DataError(f"data source {what} is {kind}, not a regular file; give a file, a directory or a glob "
                            "of data files")
    return [path for path in paths if path.is_file()]


def _format_of(path: Path) -> str | None:
    return EXTENSIONS.get(path.suffix.lower())


def _saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def stdlib_files() -> list[Path]:
    """The running Python's standard-library sources, without tests: a corpus every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    return sorted(
        (p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def _stdlib_budget(max_bytes: int | None) -> list[tuple[Path, int]]:
    """(file, bytes to read) of the non-empty stdlib files, the last one cut so the total is at most max_bytes."""
    files, budget = [], max_bytes
    for path in stdlib_files():
        size = path.stat().st_size
        if size == 0:
            continue
        if budget is not None:
            if budget <= 0:
                break
            size = min(size, budget)
            budget -= size
        files.append((path, size))
    return files

