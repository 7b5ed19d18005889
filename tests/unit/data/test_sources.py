from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from pathlib import Path

import pytest

from clustertrain.config.data_schema import SourceConfig
from clustertrain.data import readers
from clustertrain.data.sources import Document, open_source, text_of
from clustertrain.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Work in tmp_path, so that messages name short relative paths like data/a.jsonl."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()


def opened(path="data", on_bad_data="error", **fields):
    return open_source(SourceConfig(path=str(path), **fields), on_bad_data=on_bad_data, cache_dir=Path("cache"))


def texts(source, start=0, stop=None):
    return [doc.record["text"] for doc in source.read(start, len(source) if stop is None else stop)]


def rows(first, n):
    return [{"text": f"doc {i}", "n": i} for i in range(first, first + n)]


# Each writer puts shards of `sizes` records into data/ and returns their texts in order.


def write_jsonl(sizes):
    first = 0
    for k, size in enumerate(sizes):
        lines = [json.dumps(r) for r in rows(first, size)]
        lines.insert(1, "   ")  # whitespace-only lines are no records
        Path(f"data/{k:02d}.jsonl").write_text("\n".join(lines) + "\n\n")
        first += size


def write_json(sizes):
    first = 0
    for k, size in enumerate(sizes):
        records = rows(first, size)
        Path(f"data/{k:02d}.json").write_text(json.dumps(records if k % 2 else {"rows": records}))
        first += size


def write_parquet(sizes):
    first = 0
    for k, size in enumerate(sizes):
        pq.write_table(pa.Table.from_pylist(rows(first, size)), f"data/{k:02d}.parquet", row_group_size=3)
        first += size


def write_arrow(sizes, new_writer):
    first = 0
    for k, size in enumerate(sizes):
        table = pa.Table.from_pylist(rows(first, size))
        with new_writer(f"data/{k:02d}.arrow", table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
        first += size


def write_text_files(sizes):
    for i in range(sum(sizes)):
        Path(f"data/{i:03d}.txt").write_text(f"doc {i}")


def write_text_blocks(sizes):
    first = 0
    for k, size in enumerate(sizes):
        blocks = [f"doc {i}" for i in range(first, first + size)]
        Path(f"data/{k:02d}.txt").write_text("\n\n\n".join(blocks) + "\n")
        first += size


WRITERS = {
    "jsonl": (write_jsonl, {}),
    "json": (write_json, {}),
    "parquet": (write_parquet, {}),
    "arrow_stream": (lambda sizes: write_arrow(sizes, pa.ipc.new_stream), {}),
    "arrow_file": (lambda sizes: write_arrow(sizes, pa.ipc.new_file), {}),
    "text_files": (write_text_files, {}),
    "text_blocks": (write_text_blocks, {"text_unit": "block"}),
}


@pytest.mark.parametrize("kind", WRITERS)
def test_every_format_reads_any_range_across_shards(kind):
    write, fields = WRITERS[kind]
    sizes = [5, 7, 1, 4]
    write(sizes)
    source = opened(**fields)
    expected = [f"doc {i}" for i in range(sum(sizes))]
    assert len(source) == len(expected)
    docs = list(source.read(0, len(source)))
    assert [d.index for d in docs] == list(range(len(expected)))
    assert [d.record["text"] for d in docs] == expected
    for start in range(len(expected) + 1):
        for stop in range(start, len(expected) + 2):
            assert texts(source, start, stop) == expected[start:stop], (start, stop)
    if kind not in ("text_files", "text_blocks"):
        assert docs[6].record == {"text": "doc 6", "n": 6}


def test_locations_name_lines_and_rows():
    write_jsonl([3, 2])
    assert [d.location for d in opened().read(0, 5)] == [
        "data/00.jsonl:1", "data/00.jsonl:3", "data/00.jsonl:4", "data/01.jsonl:1", "data/01.jsonl:3",
    ]
    Path("p").mkdir()
    pq.write_table(pa.Table.from_pylist(rows(0, 8)), "p/a.parquet", row_group_size=3)
    assert [d.location for d in opened("p/a.parquet").read(4, 6)] == ["p/a.parquet row 4", "p/a.parquet row 5"]
    Path("data/b.txt").write_text("one\n\ntwo\nlines\n\n\nthree")
    source = opened("data/b.txt", text_unit="block")
    assert [(d.record["text"], d.location) for d in source.read(0, 3)] == [
        ("one", "data/b.txt:1"), ("two\nlines", "data/b.txt:3"), ("three", "data/b.txt:7"),
    ]


def test_glob_picks_sorted_matching_files():
    write_jsonl([2, 3, 4])
    Path("data/notes.md").write_text("ignored in a directory")
    assert texts(opened("data/0[12].jsonl")) == [f"doc {i}" for i in range(2, 9)]
    assert len(opened("data")) == 9
    with pytest.raises(DataError, match="notes.md: cannot tell the format"):
        opened("data/*")


def test_jsonl_index_seeks_and_is_cached(monkeypatch):
    Path("data/big.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(10_000)))
    scans, records_walked = [], []
    scan, walk = readers.scan_records, readers._records
    monkeypatch.setattr(readers, "scan_records", lambda *a: scans.append(a) or scan(*a))

    def counting_walk(*args):
        for record in walk(*args):
            records_walked.append(1)
            yield record

    monkeypatch.setattr(readers, "_records", counting_walk)
    source = opened("data/big.jsonl")
    assert len(source) == 10_000 and len(scans) == 1
    records_walked.clear()  # the scan walks every record once; a read after it seeks
    docs = list(source.read(5000, 5003))
    assert [(d.index, d.record["text"], d.location) for d in docs] == [
        (5000 + i, f"line {5000 + i}", f"data/big.jsonl:{5001 + i}") for i in range(3)
    ]
    assert len(records_walked) < readers.INDEX_EVERY + 4
    assert len(list(Path("cache/index").glob("lines-*.npz"))) == 1

    assert len(opened("data/big.jsonl")) == 10_000 and len(scans) == 1  # reopened from the cached index
    with open("data/big.jsonl", "a") as f:
        f.write('{"text": "one more"}\n')
    os.utime("data/big.jsonl", ns=(1, 1))
    assert len(opened("data/big.jsonl")) == 10_001 and len(scans) == 2  # a changed file is scanned again


def test_consecutive_windows_continue_one_reader_per_stream(monkeypatch):
    Path("data/big.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(10_000)))
    source = opened("data/big.jsonl")
    opens = []
    read = readers.LineRecords.read
    monkeypatch.setattr(readers.LineRecords, "read", lambda self, *a: opens.append(a) or read(self, *a))
    first, second = [], []
    for w in range(0, 5000, 500):  # two streams, interleaved, each over its half in windows
        first += texts(source, w, w + 500)
        second += texts(source, 5000 + w, 5500 + w)
    assert first + second == [f"line {i}" for i in range(10_000)]
    assert len(opens) == 2


def test_a_pickled_or_forked_source_reopens_its_readers():
    write_parquet([40])
    source = opened()
    assert texts(source, 0, 10) == [f"doc {i}" for i in range(10)]  # parks a reader at 10
    copy = pickle.loads(pickle.dumps(source))
    assert texts(copy, 10, 12) == ["doc 10", "doc 11"]
    source._pid = -1  # as seen from a forked worker
    assert texts(source, 10, 12) == ["doc 10", "doc 11"]


def test_windows_resume_past_skipped_records():
    lines = [json.dumps({"text": str(i)}) if i not in (4, 5, 9) else "{oops" for i in range(12)]
    Path("data/a.jsonl").write_text("\n".join(lines))
    source = opened("data/a.jsonl", on_bad_data="skip")
    windows = [[d.index for d in source.read(w, w + 5)] for w in (0, 5, 10)]
    assert windows == [[0, 1, 2, 3], [6, 7, 8], [10, 11]]
    assert source.skipped == Counter({"malformed JSON": 3})


def test_text_blocks_index_past_one_mark():
    Path("data/a.txt").write_text("\n\n".join(f"block {i}\nsecond line" for i in range(3000)))
    source = opened("data/a.txt", text_unit="block")
    assert len(source) == 3000
    docs = list(source.read(2500, 2502))
    assert [d.record["text"] for d in docs] == ["block 2500\nsecond line", "block 2501\nsecond line"]
    assert docs[0].location == f"data/a.txt:{2500 * 3 + 1}"


# Bad data: (file, bytes, extra source fields, message under "error", reason and texts yielded under "skip").
BAD = {
    "empty jsonl": ("data/a.jsonl", b"", {}, "data/a.jsonl: empty file", "empty file", []),
    "blank jsonl": ("data/a.jsonl", b" \n\n\t\n", {}, "data/a.jsonl: empty file", "empty file", []),
    "empty txt": ("data/a.txt", b"", {}, "data/a.txt: empty file", "empty file", []),
    "blank txt": ("data/a.txt", b"  \n\n", {}, "data/a.txt: empty file", "empty file", []),
    "empty json": ("data/a.json", b"[]", {}, "data/a.json: empty file", "empty file", []),
    "empty parquet": ("data/a.parquet", b"", {}, "data/a.parquet: empty file", "empty file", []),
    "malformed line": (
        "data/a.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": 1 2}\n', {},
        "data/a.jsonl:3: malformed JSON (Expecting ',' delimiter at column 12)", "malformed JSON", ["a", "b"],
    ),
    "jsonl not UTF-8": (
        "data/a.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n{"text": "c"}\n', {},
        "data/a.jsonl:2: not UTF-8 (byte 0xff at offset 24)", "not UTF-8", ["a", "c"],
    ),
    "txt not UTF-8": (
        "data/a.txt", b"hello \xff", {}, "data/a.txt: not UTF-8 (byte 0xff at offset 6)", "not UTF-8", [],
    ),
    "block not UTF-8": (
        "data/a.txt", b"one\n\ntwo \xfe\n", {"text_unit": "block"},
        "data/a.txt:3: not UTF-8 (byte 0xfe at offset 9)", "not UTF-8", ["one"],
    ),
    "not an object": (
        "data/a.jsonl", b'{"text": "a"}\n[1, 2]\n', {},
        "data/a.jsonl:2: not a JSON object (got array)", "not a JSON object", ["a"],
    ),
    "json record not an object": (
        "data/a.json", b'[{"text": "a"}, "b"]', {},
        "data/a.json record 1: not a JSON object (got string)", "not a JSON object", ["a"],
    ),
    "malformed json file": (
        "data/a.json", b'[{"text": "a"},\n {"text": 1 2}]', {},
        "data/a.json:2: malformed JSON (Expecting ',' delimiter at column 13)", "malformed JSON", [],
    ),
    "unreadable parquet": (
        "data/a.parquet", b"not parquet at all", {},
        "data/a.parquet: not a readable Parquet file (", "unreadable file", [],
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_data_errors_name_file_and_line(case):
    name, content, fields, message, _, _ = BAD[case]
    Path(name).write_bytes(content)
    with pytest.raises(DataError) as error:
        source = opened(name, **fields)
        list(source.read(0, len(source)))
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", BAD)
def test_bad_data_is_skipped_and_counted(case):
    name, content, fields, _, reason, kept = BAD[case]
    Path(name).write_bytes(content)
    source = opened(name, on_bad_data="skip", **fields)
    docs = list(source.read(0, len(source)))
    assert [d.record["text"] for d in docs] == kept
    assert source.skipped == Counter({reason: 1})
    if kept:
        assert len(source) == len(kept) + 1  # the bad record keeps its index


def test_an_empty_shard_adds_no_documents_under_skip():
    write_jsonl([2, 3])
    Path("data/01.jsonl").write_text("\n")
    source = opened(on_bad_data="skip")
    assert texts(source) == ["doc 0", "doc 1"] and source.skipped == Counter({"empty file": 1})


def test_missing_path():
    with pytest.raises(DataError) as error:
        opened("x/*.jsonl")
    assert str(error.value) == "data source 'x/*.jsonl': no such file, directory or matching files"


def test_mixed_formats_need_a_format():
    write_jsonl([2])
    write_parquet([2])
    with pytest.raises(DataError, match="mixes jsonl and parquet files"):
        opened("data")
    assert len(opened("data", format="parquet")) == 2


def test_text_of():
    doc = Document(3, {"text": "hi", "n": 1}, "data/a.jsonl:4")
    assert text_of(doc, "text") == "hi"
    with pytest.raises(DataError) as error:
        text_of(doc, "content")
    assert str(error.value) == "data/a.jsonl:4: record has no field 'content' (fields: text, n)"
    with pytest.raises(DataError, match=r"^data/a.jsonl:4: field 'n' is number, not a string$"):
        text_of(doc, "n")


def test_tokens_are_not_documents():
    Path("data/a.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(ValueError, match="token files"):
        opened("data/a.npy")


# Hugging Face datasets: save_to_disk directories and the local HF cache.


def test_hf_disk_dataset_dict_split():
    datasets = pytest.importorskip("datasets")
    splits = {"train": rows(0, 2500), "test": rows(100, 7)}
    saved = datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})
    saved.save_to_disk("dd")
    source = opened("dd", split="test")
    assert len(source) == 7 and source.format == "hf_disk"
    assert [d.record for d in source.read(2, 4)] == rows(102, 2)
    assert next(source.read(5, 6)).location == "dd row 5"
    train = opened("dd/train", format="hf_disk")  # one split's directory is a saved Dataset
    assert [d.record["n"] for d in train.read(1020, 1030)] == list(range(1020, 1030))
    with pytest.raises(DataError, match=r"^dd: no split 'validation' \(splits: train, test\)$"):
        opened("dd", split="validation")
    # the .arrow files inside are Arrow IPC streams
    arrow = opened("dd/test/*.arrow")
    assert arrow.format == "arrow" and [d.record for d in arrow.read(0, 7)] == splits["test"]


@pytest.fixture
def hf_caches(tmp_path, monkeypatch):
    """Empty datasets and hub caches in tmp_path; offline, so nothing can reach the network."""
    datasets = pytest.importorskip("datasets")
    hub = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    return tmp_path / "hf-datasets", tmp_path / "hf-hub"


def hf_source(name, split="train"):
    return open_source(SourceConfig(hf_name=name, split=split), cache_dir=Path("cache"))


def test_hf_not_cached_says_how_to_fetch(hf_caches):
    with pytest.raises(DataError) as error:
        hf_source("nobody/nothing")
    message = str(error.value)
    assert message.startswith("hf dataset 'nobody/nothing' is not in the local Hugging Face caches (")
    assert message.endswith("hf download --repo-type dataset nobody/nothing") and "\n" not in message


def test_hf_reads_a_prepared_dataset_from_the_datasets_cache(hf_caches):
    from datasets.packaged_modules.json.json import Json

    datasets_cache, _ = hf_caches
    Path("data/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(0, 5)))
    # what load_dataset("me/tiny") leaves in the cache after a download: <ns>___<name>/<config>/<version>/<hash>
    builder = Json(
        cache_dir=str(datasets_cache / "build"), dataset_name="tiny", config_name="default", config_id="default",
        data_files={"train": [str(Path("data/train.jsonl").resolve())]}, hash="0123abcd",
    )
    builder.download_and_prepare()
    (datasets_cache / "build" / "tiny").rename(datasets_cache / "me___tiny")
    source = hf_source("me/tiny")
    assert len(source) == 5 and source.label == "me/tiny"
    assert [d.record for d in source.read(1, 3)] == rows(1, 2)
    assert next(source.read(4, 5)).location == "me/tiny[train] row 4"
    with pytest.raises(DataError, match=r"^hf dataset 'me/tiny': Unknown split"):
        hf_source("me/tiny", split="test")


def test_hf_reads_a_hub_snapshot(hf_caches):
    _, hub_cache = hf_caches
    repo = hub_cache / "datasets--me--snap"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc" / "data").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(0, 4)))
    source = hf_source("me/snap")
    assert [d.record["text"] for d in source.read(0, 9)] == [f"doc {i}" for i in range(4)]


def test_stdlib_has_documents_and_honours_max_bytes():
    source = open_source(SourceConfig(format="stdlib", max_bytes=50_000), cache_dir=Path("cache"))
    docs = list(source.read(0, len(source)))
    assert docs and len(docs) == len(source)
    assert sum(len(d.record["text"].encode()) for d in docs) <= 50_000
    assert all(d.location.endswith(".py") for d in docs)
    assert not any("/test/" in d.location or "site-packages" in d.location for d in docs)
    everything = open_source(SourceConfig(format="stdlib"), cache_dir=Path("cache"))
    assert len(everything) > 10 * len(source)


def test_a_line_index_is_as_readable_as_the_umask_says():
    write_jsonl([3])
    previous = os.umask(0o027)
    try:
        opened("data/00.jsonl")
    finally:
        os.umask(previous)
    (index,) = Path("cache/index").iterdir()  # written whole, then renamed: no partial file is left beside it
    assert index.stat().st_mode & 0o777 == 0o640
