"""`metrics.profile` on a GPU: the trace holds the GPU's kernels, and a CUDA memory snapshot is written beside it."""

from __future__ import annotations

import json
import pickle

from helpers import train


def test_profile_traces_gpu_kernels_and_snapshots_cuda_memory(tmp_path):
    result = train(tmp_path, "metrics.profile=[2,3]", "train.steps=4", "checkpoint.every=0")
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0-memory.pickle", "rank0-steps2-3.pt.trace.json"]
    events = json.loads((folder / "rank0-steps2-3.pt.trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("cat") == "kernel" for e in events), "no GPU kernel in the trace"
    snapshot = pickle.loads((folder / "rank0-memory.pickle").read_bytes())  # written by this test's own run
    assert snapshot["segments"], "no allocator segments in the snapshot"
    assert any(trace for trace in snapshot["device_traces"]), "no allocation recorded while profiling"
    assert "CUDA memory in" in result.stdout and "memory_viz" in result.stdout
