"""The first real error of any rank is the one shown, once, and recorded in status.json; a DataLoader worker's
error arrives as its own one line. Real 2-rank runs over a JSONL file with one bad line that only one rank reads."""

from __future__ import annotations

import json

import pytest
from helpers import train

from clustertrain.config.data_schema import DataConfig
from clustertrain.data.tokenize import train_bpe
from clustertrain.run_dir import RunDir
from clustertrain.train.status import read_status

pytestmark = pytest.mark.dist
DOCS = 400  # 8 streams of 50 lines each (data.shuffle_buffer=1: in file order); rank 1 serves streams 4-7
# The 21st line of stream 0 (rank 0's) and of stream 4 (rank 1's): read at step 6, after the start (bad data in
# the first batch refuses the start, and a refused start writes no status.json)
BAD_LINE = {0: 21, 1: 221}
EXPECTED = "malformed JSON (Expecting ',' delimiter at column 12)"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """For each rank, a JSONL file whose one malformed line only that rank reads; a tokenizer trained on good data."""
    root = tmp_path_factory.mktemp("data")
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) for i in range(DOCS)]
    (root / "good.jsonl").write_text("\n".join(lines) + "\n")
    for rank, line in BAD_LINE.items():
        bad = list(lines)
        bad[line - 1] = '{"text": 1 2}'
        (root / f"bad-rank{rank}.jsonl").write_text("\n".join(bad) + "\n")
    train_bpe(DataConfig.model_validate({"sources": [{"path": str(root / "good.jsonl")}], "vocab_size": 512}),
              root / "tokenizer")  # here, not by the CLI: one process start less
    return root


def overrides(data, rank, *extra):
    """Over TINY (data.num_workers=0: no worker processes unless a test sets them)."""
    return (f"data.sources=[{{path: {data / f'bad-rank{rank}.jsonl'}}}]", f"data.tokenizer={data / 'tokenizer'}",
            "data.shuffle_buffer=1", "train.steps=12", "checkpoint.every=0", *extra)


@pytest.mark.parametrize("rank", [1, 0], ids=["rank-1-reads-it", "rank-0-reads-it"])
def test_a_bad_line_one_rank_reads_is_the_one_error_shown_and_recorded(data, tmp_path, rank):
    # rank 1's error reaches rank 0 as a gloo "connection closed"; rank 0's reaches rank 1 the same way: neither
    # gloo error is shown, recorded or decides the exit code
    result = train(tmp_path, *overrides(data, rank), nproc=2, expect=2, state="failed")  # after the start
    message = f"{data / f'bad-rank{rank}.jsonl'}:{BAD_LINE[rank]}: {EXPECTED}"
    assert result.stderr.strip() == f"error: {message}", result.stderr[-3000:]  # once, no traceback
    status = read_status(RunDir(tmp_path))
    assert status["error"] == f"DataError: {message}" + (" (rank 1)" if rank else ""), status


def test_a_data_error_in_a_loader_worker_is_its_own_one_line(data, tmp_path):
    result = train(tmp_path, *overrides(data, 0, "data.num_workers=1"), expect=2, state="failed")
    message = f"{data / 'bad-rank0.jsonl'}:{BAD_LINE[0]}: {EXPECTED}"
    assert result.stderr.strip() == f"error: {message}", result.stderr[-3000:]
    assert read_status(RunDir(tmp_path))["error"] == f"DataError: {message}"
