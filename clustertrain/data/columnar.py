"""Parquet, Arrow and Hugging Face `datasets` readers: tables that know their row counts from their metadata.

Each is a shard of `clustertrain.data.sources` (see `clustertrain.data.readers.Shard`): Parquet and Arrow files
are read in batches of BATCH_ROWS rows; `datasets` directories and caches are memory-mapped and read by row slices.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path

from clustertrain.data.readers import BadData, Row
from clustertrain.errors import DataError, first_line

BATCH_ROWS = 1024


def _arrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError("reading Parquet and Arrow files needs pyarrow: pip install pyarrow") from None
    return pyarrow


def _unreadable(path: Path, kind: str, error: Exception, bad: BadData) -> None:
    bad.report("unreadable file", f"{path}: not a readable {kind} file ({first_line(error)})")


class ParquetFile:
    """A Parquet file: the row count and row-group sizes come from its footer; reads go group by group."""

    def __init__(self, path: Path, group_rows: list[int]) -> None:
        self.path = path
        self.group_starts = list(accumulate(group_rows, initial=0))
        self.count = self.group_starts[-1]

    @classmethod
    def open(cls, path: Path, bad: BadData) -> ParquetFile | None:
        pa = _arrow()
        try:
            with pa.parquet.ParquetFile(path, memory_map=True) as f:
                meta = f.metadata
                return cls(path, [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        except (pa.ArrowException, OSError) as e:
            _unreadable(path, "Parquet", e, bad)
            return None

    def read(self, start: int, stop: int) -> Iterator[Row]:
        pa = _arrow()
        first = bisect_right(self.group_starts, start) - 1
        groups = [g for g in range(first, len(self.group_starts) - 1) if self.group_starts[g] < stop]
        index = self.group_starts[first]
        with pa.parquet.ParquetFile(self.path, memory_map=True) as f:
            for batch in f.iter_batches(batch_size=BATCH_ROWS, row_groups=groups):
                yield from _batch_rows(batch, index, start, stop, f"{self.path} row")
                index += batch.num_rows
                if index >= stop:
                    return


def _batch_rows(batch, index: int, start: int, stop: int, where: str) -> Iterator[Row]:
    """The rows of an Arrow batch that begins at row `index` and fall in [start, stop)."""
    lo, hi = max(start - index, 0), min(stop - index, batch.num_rows)
    if lo < hi:
        for row, record in enumerate(batch.slice(lo, hi - lo).to_pylist(), index + lo):
            yield row, record, f"{where} {row}"


class ArrowFile:
    """An Arrow IPC file, in the stream format `datasets` writes or the file format; memory-mapped."""

    def __init__(self, path: Path, count: int) -> None:
        self.path, self.count = path, count

    @classmethod
    def open(cls, path: Path, bad: BadData) -> ArrowFile | None:
        pa = _arrow()
        try:
            with _ipc_table(pa, path) as table:
                return cls(path, table.num_rows)
        except (pa.ArrowException, OSError) as e:
            _unreadable(path, "Arrow", e, bad)
            return None

    def read(self, start: int, stop: int) -> Iterator[Row]:
        with _ipc_table(_arrow(), self.path) as table:
            index = start
            for batch in table.slice(start, stop - start).to_batches(max_chunksize=BATCH_ROWS):
                yield from _batch_rows(batch, index, start, stop, f"{self.path} row")
                index += batch.num_rows


@contextmanager
def _ipc_table(pa, path: Path):
    # Reading all batches of a memory map only parses their headers; the table's buffers stay on disk.
    with pa.memory_map(str(path)) as source:
        is_file_format = source.read(6) == b"ARROW1"
        source.seek(0)
        reader = pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)
        yield reader.read_all()


# Hugging Face `datasets`: save_to_disk directories and the local HF cache.


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("hf and hf_disk sources need the datasets package: pip install datasets") from None
    return datasets


class DatasetRows:
    """A memory-mapped `datasets.Dataset`, read by row slices."""

    def __init__(self, dataset, where: str) -> None:
        self.dataset, self.where = dataset.with_format("arrow"), where
        self.count = len(dataset)

    def read(self, start: int, stop: int) -> Iterator[Row]:
        for lo in range(start, min(stop, self.count), BATCH_ROWS):
            table = self.dataset[lo:min(lo + BATCH_ROWS, stop, self.count)]
            for row, record in enumerate(table.to_pylist(), lo):
                yield row, record, f"{self.where} {row}"


def open_hf_disk(path: Path, split: str) -> DatasetRows:
    """A directory written by `Dataset.save_to_disk`, or one split of a saved `DatasetDict`."""
    datasets = _datasets()
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"{path}: not a directory written by datasets' save_to_disk ({first_line(e)})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DataError(f"{path}: no split '{split}' (splits: {', '.join(dataset)})")
        dataset = dataset[split]
    return DatasetRows(dataset, f"{path} row")


@contextmanager
def _offline():
    # datasets and huggingface_hub read HF_HUB_OFFLINE once at import, so the switch is their module constant.
    import datasets.config
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def open_hf(name: str, config: str | None, split: str) -> DatasetRows:
    """A dataset from the local HF caches only, never the network.

    Either `datasets` prepared it before (load_dataset on a machine with network), or its hub snapshot
    was downloaded (`hf download --repo-type dataset NAME`), which is converted once into the datasets cache.
    """
    datasets = _datasets()
    from huggingface_hub import constants, snapshot_download

    where = f"{name}[{split}] row"
    with _offline():
        try:
            return DatasetRows(datasets.load_dataset(name, config, split=split), where)
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the snapshot is the second chance
            first = e
        try:
            snapshot = snapshot_download(name, repo_type="dataset", local_files_only=True)
        except Exception:  # noqa: BLE001 - any failure here means: not downloaded
            if isinstance(first, (ConnectionError, FileNotFoundError)):
                caches = f"{datasets.config.HF_DATASETS_CACHE}, {constants.HF_HUB_CACHE}"
                raise DataError(
                    f"hf dataset '{name}' is not in the local Hugging Face caches ({caches}); fetch it on a machine "
                    f"with network and the same HF_HOME: hf download --repo-type dataset {name}"
                ) from None
            raise DataError(f"hf dataset '{name}': {first_line(first)}") from None
        try:
            return DatasetRows(datasets.load_dataset(snapshot, config, split=split), where)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"hf dataset '{name}' (snapshot {snapshot}): {first_line(e)}") from None


