"""Pre-tokenized token files (.npy, or raw .bin of uint16/uint32 ids as nanoGPT and Megatron write them).

Files are memory-mapped and cut into non-overlapping windows of seq_len + 1 tokens; each window is one
"document", so it becomes exactly one training sequence. Shards (several files) are read in sorted order.
"""

from __future__ import annotations

import glob
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from clustertrain.config.data_schema import SourceConfig
from clustertrain.data.sources import Document, regular_files
from clustertrain.errors import DataError


def is_token_source(source: SourceConfig) -> bool:
    """Whether a source holds token ids rather than text."""
    return source.format == "tokens" or (source.format == "auto" and str(source.path).endswith((".npy", ".bin")))


class TokenSource:
    """Windows of `seq_len + 1` token ids over memory-mapped token files."""

    def __init__(self, source: SourceConfig, seq_len: int, vocab_size: int):
        self.label = source.label
        self.window = seq_len + 1
        self.vocab_size = vocab_size
        self.skipped: Counter = Counter()
        self.arrays = [(path, _open(path, source.token_dtype)) for path in _files(source.path or "")]
        self.counts = np.cumsum([0] + [len(a) // self.window for _, a in self.arrays])
        if self.counts[-1] == 0:
            raise DataError(f"data source {source.path!r}: fewer than seq_len + 1 = {self.window} tokens")

    def __len__(self) -> int:
        return int(self.counts[-1])

    def read(self, start: int, stop: int) -> Iterator[Document]:
        """Windows [start, stop), each checked against the vocabulary."""
        for index in range(start, stop):
            shard = int(np.searchsorted(self.counts, index, side="right")) - 1
            path, array = self.arrays[shard]
            begin = (index - int(self.counts[shard])) * self.window
            ids = np.asarray(array[begin : begin + self.window], dtype=np.int64)
            if ids.max() >= self.vocab_size or ids.min() < 0:
                bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
                raise DataError(
                    f"{path}: token id {bad} at window {index} is outside the vocabulary of "
                    f"{self.vocab_size} tokens (wrong token_dtype or tokenizer?)"
                )
            yield Document(index, {"ids": ids}, f"{path} tokens [{begin}, {begin + self.window})")


def _files(pattern: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".bin"))
    else:
        files = [path] if path.exists() else sorted(Path(p) for p in glob.glob(str(path), recursive=True))
    files = regular_files(files, pattern)
    if not files:
        raise DataError(f"data source {pattern!r}: no such file, directory or matching .npy/.bin files")
    return files


def _open(path: Path, dtype: str) -> np.ndarray:
    try:
        if path.suffix == ".npy":
            with open(path, "rb") as f:
                if f.read(6) != b"\x93NUMPY":  # else np.load would take it for a pickle
                    raise DataError(f"{path}: not a .npy file (no NumPy header); token files are .npy or raw .bin")
            array = np.load(path, mmap_mode="r")  # allow_pickle=False: an object array is refused
            if array.ndim != 1 or array.dtype.kind not in "ui":
                raise DataError(f"{path}: expected a 1-D array of integer token ids, got {array.dtype} {array.shape}")
            return array
        return np.memmap(path, dtype=np.dtype(dtype), mode="r")
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: cannot read token ids: {e}") from None
