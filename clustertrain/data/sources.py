"""Where documents come from: the embedded standard-library corpus and local text files."""

from __future__ import annotations

import glob
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from clustertrain.config.schema import SourceConfig
from clustertrain.errors import DataError


def read_documents(source: SourceConfig) -> Iterator[str]:
    """Yield the documents of one source in a fixed order, up to `source.max_bytes` bytes."""
    files = stdlib_files() if source.format == "stdlib" else text_files(source.path or "")
    budget = source.max_bytes
    for path in files:
        if budget <= 0:
            return
        try:
            text = path.read_bytes()[:budget].decode("utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        budget -= len(text.encode())
        if text.strip():
            yield text


def stdlib_files() -> list[Path]:
    """The running Python's standard-library sources, without tests: a corpus every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    return sorted(
        (p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def text_files(pattern: str) -> list[Path]:
    """Files named by a path, a directory (all .txt inside, recursively) or a glob, sorted."""
    path = Path(pattern).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"data source {pattern!r}: no such file, directory or matching files")
    return files
