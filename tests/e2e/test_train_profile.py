"""`metrics.profile` through the CLI: a trace per rank of just the profiled steps; a bad range: one line, exit 2."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, run_cli, train


@pytest.mark.dist
def test_profile_writes_a_trace_per_rank_of_the_profiled_steps(tmp_path):
    result = train(tmp_path, "metrics.profile=[2,3]", "train.steps=4", nproc=2)
    folder = tmp_path / "profile"
    traces = ["rank0-steps2-3.pt.trace.json", "rank1-steps2-3.pt.trace.json"]
    assert sorted(p.name for p in folder.iterdir()) == traces  # and no memory snapshot without CUDA
    for rank in (0, 1):
        events = json.loads((folder / f"rank{rank}-steps2-3.pt.trace.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3"}
        assert any(n.startswith("aten::") for n in names)  # the model's ops
        assert any(n.startswith("gloo:") for n in names)  # and the gradient all-reduce
    assert result.stdout.count("profile: steps 2-3 traced to") == 1  # rank 0 says where, once


def test_a_range_past_the_run_is_one_line_and_exit_2(tmp_path):
    result = run_cli("train", *(f"--set={o}" for o in (*TINY, f"train.run_dir={tmp_path}", "train.steps=5",
                                                         "metrics.profile=[4,9]")))
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error: metrics.profile = [4, 9]: the run has 5 steps; profile steps within [1, 5]"
    ), result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "profile").exists()
