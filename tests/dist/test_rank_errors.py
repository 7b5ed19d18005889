"""The first real error of any rank is the one shown, once, and recorded in status.json; a DataLoader worker's
error arrives as its own one line. Real 2-rank runs over a JSONL file whose one bad line only rank 1 reads."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, run_cli, train

from clustertrain.train.status import read_status

pytestmark = pytest.mark.dist
DOCS, BAD_LINE = 400, 390  # rank 1 serves streams 4-7 of 8: the last half of the file
EXPECTED = "malformed JSON (Expecting ',' delimiter at column 12)"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A JSONL file with one malformed line in rank 1's share, and a tokenizer trained on good data."""
    root = tmp_path_factory.mktemp("data")
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) for i in range(DOCS)]
    (root / "good.jsonl").write_text("\n".join(lines) + "\n")
    lines[BAD_LINE - 1] = '{"text": 1 2}'
    (root / "bad.jsonl").write_text("\n".join(lines) + "\n")
    result = run_cli("tokenizer", "train", str(root / "tokenizer"),
                     f"--set=data.sources=[{{path: {root / 'good.jsonl'}}}]", "--set=data.vocab_size=512")
    assert result.returncode == 0, result.stderr
    return root


def overrides(data, *extra):
    return (f"data.sources=[{{path: {data / 'bad.jsonl'}}}]", f"data.tokenizer={data / 'tokenizer'}",
            "data.shuffle_buffer=1", "train.steps=40", "checkpoint.every=0", *extra)


def test_a_bad_line_only_rank_1_reads_is_the_one_error_shown_and_recorded(data, tmp_path):
    result = train(tmp_path, *overrides(data, "data.num_workers=0"), nproc=2, expect=2)
    message = f"{data / 'bad.jsonl'}:{BAD_LINE}: {EXPECTED}"
    assert result.stderr.strip() == f"error: {message}", result.stderr[-3000:]  # once, not gloo's
    status = read_status(tmp_path)
    assert status["state"] == "failed" and status["error"] == f"DataError: {message} (rank 1)", status


def test_a_data_error_in_a_loader_worker_is_its_own_one_line(data, tmp_path):
    result = train(tmp_path, *overrides(data, "data.num_workers=1"), expect=2)
    assert result.stderr.strip() == f"error: {data / 'bad.jsonl'}:{BAD_LINE}: {EXPECTED}", result.stderr[-3000:]
    assert read_status(tmp_path)["error"] == f"DataError: {data / 'bad.jsonl'}:{BAD_LINE}: {EXPECTED}"
