"""CSV sources: a header row names the columns; rows are records (a text column, or prompt and completion)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from clustertrain.config.data_schema import DataConfig, SourceConfig
from clustertrain.data.loader import StreamLoader
from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.data.plan import DataPlan
from clustertrain.data.sources import open_source
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.errors import DataError


def opened(path: Path, on_bad_data: str = "error"):
    return open_source(SourceConfig(path=str(path)), on_bad_data=on_bad_data, cache_dir=path.parent / "cache")


def test_quoted_line_breaks_doubled_quotes_and_blank_lines(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text('prompt,completion\n"What is 2+2?","4, of course"\n"A line\n\nbreak, ""quoted""",yes\n\nplain,row\n')
    docs = list(opened(path).read(0, 3))
    assert [d.record for d in docs] == [{"prompt": "What is 2+2?", "completion": "4, of course"},
                                        {"prompt": 'A line\n\nbreak, ""quoted""'.replace('""', '"'), "completion": "yes"},
                                        {"prompt": "plain", "completion": "row"}]
    assert [d.location for d in docs] == [f"{path}:2", f"{path}:3", f"{path}:7"]


def test_a_large_file_seeks_through_its_index(tmp_path):
    path = tmp_path / "big.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "text"])
        writer.writerows([i, f"row {i}" + ("\nsecond line" if i % 3 == 0 else "")] for i in range(3000))
    source = opened(path)
    assert len(source) == 3000
    docs = list(source.read(2500, 2503))
    assert [(d.index, d.record["id"], d.record["text"].split("\n")[0]) for d in docs] == [
        (2500 + i, str(2500 + i), f"row {2500 + i}") for i in range(3)]


@pytest.mark.parametrize(("content", "message"), [
    ("text,text\na,b\n", "the header row names columns ['text', 'text']: each must be named once"),
    ("text,source\nhello,web\nonly one field\n", ":3: 1 fields, but the header names 2 (text, source)"),
    ('text\n"never closed\n', ":2: not a CSV row (unexpected end of data)"),
])
def test_a_bad_row_or_header_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(DataError) as error:
        list(opened(path).read(0, 10))
    assert message in str(error.value) and str(path) in str(error.value)


def test_skip_counts_a_bad_row_and_reads_the_rest(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("text,source\nhello,web\nonly one field\nbye,book\n")
    source = opened(path, on_bad_data="skip")
    assert [d.record["text"] for d in source.read(0, 3)] == ["hello", "bye"]
    assert source.skipped["bad CSV row"] == 1


def test_prompt_and_completion_columns_train_sft_on_the_completion(tmp_path):
    path = tmp_path / "sft.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "completion"])
        writer.writerows([f"question {i} alpha{i % 7} ", f"answer beta{i % 5}"] for i in range(60))
    data = DataConfig.model_validate({"mode": "sft", "sources": [{"path": str(path)}], "seq_len": 48,
                                      "vocab_size": 300, "cache_dir": str(tmp_path / "cache")})
    plan = DataPlan(data, load_tokenizer(data), 4, seed=1, cache_dir=tmp_path / "cache")
    batch = StreamLoader(plan, 0, 1).next_batch()
    for labels in batch["labels"]:
        trained = plan.tokenizer.decode([t for t in labels.tolist() if t != IGNORE_INDEX])
        assert "answer" in trained and "alpha" not in trained, json.dumps(trained)
