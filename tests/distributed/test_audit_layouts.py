"""The resume audit under tensor and pipeline parallelism (real 2-rank runs): ranks that share a data-parallel rank
read the same rows, and each global batch is recorded once, so an honest run reports no repeat."""

from __future__ import annotations

import pytest
from helpers import train

from clustertrain.cli import main
from clustertrain.data.audit import read_audit

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_the_audit_records_each_sample_once_per_data_parallel_rank(layout, tmp_path, capsys):
    train(tmp_path, "data.audit=true", "train.steps=3", layout, nproc=2)
    recorded = read_audit(tmp_path / "samples.jsonl")
    assert sorted(recorded) == [1, 2, 3]
    assert all(len(samples) == 8 for samples in recorded.values()), recorded  # train.global_batch_size
    capsys.readouterr()
    code = main(["data", "audit", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and "repeated 0, skipped 0, unexpected 0" in lines, lines
