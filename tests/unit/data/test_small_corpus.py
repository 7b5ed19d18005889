"""A corpus smaller than the global batch: a .txt of one example per line, or one document for every row.

No two rows of a global batch may be the same, resumption stays exact, and the run says what it did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_loader import run

from clustertrain.config.data_schema import DataConfig
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import load_tokenizer

ROWS = 8
LINES = [f"example {i}: " + " ".join(f"w{(i * 7 + j) % 41}" for j in range(30)) for i in range(20)]


def plan_of(tmp_path, text_unit, **data):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    config = DataConfig.model_validate({"sources": [{"path": str(corpus), "text_unit": text_unit}], "seq_len": 32,
                                        "vocab_size": 300, "cache_dir": str(tmp_path / "cache"), **data})
    return DataPlan(config, load_tokenizer(config), ROWS, seed=3, cache_dir=tmp_path / "cache")


def distinct_rows(batch) -> int:
    return len({tuple(row.tolist()) for row in batch["input_ids"]})


@pytest.mark.parametrize("text_unit", ["line", "file"])
def test_every_row_of_a_global_batch_differs_on_two_ranks(tmp_path, text_unit):
    plan = plan_of(tmp_path, text_unit)
    batches, _ = run(plan, dp_size=2, steps=3)
    for batch in batches:
        assert distinct_rows(batch) == ROWS, batch["origins"]


def test_line_unit_reads_a_document_per_line_and_holds_some_out(tmp_path):
    plan = plan_of(tmp_path, "line", eval_fraction=0.1)
    assert len(plan.sources[0]) == 20
    assert len(plan.splits[0]["train"]) == 18 and len(plan.splits[0]["eval"]) == 2
    assert plan.notes == []
    tokenizer = plan.tokenizer
    first = [int(t) for t in plan.stream(0, "train").next().input_ids]
    assert any(line.startswith(tokenizer.decode(first)) for line in LINES)  # a row starts at a line's start


def test_one_document_for_many_rows_is_split_and_said(tmp_path):
    plan = plan_of(tmp_path, "file", eval_fraction=0.1)
    assert len(plan.sources[0]) == 1
    assert len(plan.notes) == 2, plan.notes
    assert "1 training document(s) for the 8 rows" in plan.notes[0] and "text_unit: line" in plan.notes[0]
    assert "no evaluation" in plan.notes[1] and not plan.has_eval()
    starts = sorted(plan.stream(s, "train").next().origin[2] for s in range(ROWS))
    assert len(set(starts)) == ROWS and starts[0] == 0  # eight points spread over the one document


def test_block_is_the_older_name_of_paragraph(tmp_path):
    assert plan_of(tmp_path, "block").data.sources[0].text_unit == "paragraph"


def test_a_shared_document_resumes_exactly_on_another_rank_count(tmp_path):
    plan = plan_of(tmp_path, "file")
    straight, _ = run(plan, dp_size=2, steps=4)
    _, state = run(plan, dp_size=2, steps=2)
    resumed, _ = run(plan, dp_size=4, steps=2, state=state)
    for a, b in zip(straight[2:], resumed):
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["origins"] == b["origins"]
    assert np.all([distinct_rows(b) == ROWS for b in resumed])


@pytest.mark.parametrize("mode", ["pretrain", "sft"])
def test_one_epoch_is_the_sequences_of_one_pass_with_no_repeat(tmp_path, mode):
    if mode == "sft":
        corpus = tmp_path / "sft.jsonl"
        corpus.write_text("".join(f'{{"prompt": "q{i} {LINES[i][:40]}", "completion": " a{i}"}}\n' for i in range(20)))
        source = {"path": str(corpus)}
    else:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("\n".join(LINES * 3) + "\n")
        source = {"path": str(corpus), "text_unit": "line"}
    config = DataConfig.model_validate({"mode": mode, "sources": [source], "seq_len": 32, "vocab_size": 300,
                                        "eval_fraction": 0, "cache_dir": str(tmp_path / "cache")})
    plan = DataPlan(config, load_tokenizer(config), 4, seed=3, cache_dir=tmp_path / "cache")
    steps = plan.sequences_per_epoch(list(range(4)))
    assert steps >= 1
    batches, _ = run(plan, dp_size=2, steps=steps)
    origins = [o for batch in batches for o in batch["origins"]]
    assert len(set(origins)) == len(origins)  # one epoch repeats nothing
    assert {o[4] for o in origins} == {0}  # and stays in the first pass
    more, _ = run(plan, dp_size=2, steps=steps + 2)
    assert any(o[4] == 1 for o in more[-1]["origins"])  # a fuller epoch would have repeated a sample


@pytest.mark.parametrize("text_unit", ["line", "file"])
def test_a_stream_s_epoch_serves_each_of_its_documents_once_then_the_next_begins(tmp_path, text_unit):
    """Each stream's cursor, walked for as many documents as its slice holds (a bounded loop: a dropped document
    fails here, it does not hang a test): each document once in epoch 0, the last included, then epoch 1 begins."""
    plan = plan_of(tmp_path, text_unit, shuffle_buffer=4)
    for s in range(ROWS):
        cursor = plan.stream(s, "train").packers[0].cursor
        order = cursor.orders[0]
        slice_ = {order.source.index(order.lo + p) for p in range(order.length)}
        served = []
        for _ in range(order.length):
            assert cursor.current_epoch() == 0, f"stream {s}: epoch 1 began after {served}, before all of {slice_}"
            served.append(cursor.current()[1])
            cursor.advance()
        assert sorted(served) == sorted(slice_), f"stream {s} served {served} of {sorted(slice_)} in epoch 0"
        assert cursor.positions == [[1, 0]], f"stream {s}: at {cursor.positions} after its {order.length} documents"
