"""StepProfiler on its own: the range check, which steps it traces, and a run that ends inside the range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clustertrain.errors import ConfigError
from clustertrain.train.profile import StepProfiler, check_profile_range


def step_markers(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}


def fake_steps(profiler: StepProfiler, steps: range) -> None:
    a = torch.randn(32, 32)
    for step in steps:
        profiler.step_started(step)
        a = (a @ a).tanh()
        profiler.step_done(step)


@pytest.mark.parametrize(("steps", "message"), [
    ((0, 2), "metrics.profile = [0, 2]: steps count from 1"),
    ((3, 2), "metrics.profile = [3, 2]: the first step comes after the last"),
    ((2, 11), "metrics.profile = [2, 11]: the run has 10 steps; profile steps within [1, 10]"),
])
def test_bad_ranges_are_config_errors(steps, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_profile_range(steps, total_steps=10)


def test_off_by_default_writes_nothing(tmp_path):
    profiler = StepProfiler(None, 10, tmp_path / "profile", torch.device("cpu"), rank=0)
    fake_steps(profiler, range(1, 5))
    profiler.close()
    assert not (tmp_path / "profile").exists()


def test_traces_only_the_range(tmp_path):
    lines = []
    profiler = StepProfiler((2, 3), 5, tmp_path / "profile", torch.device("cpu"), rank=3, log=lines.append)
    fake_steps(profiler, range(1, 6))
    profiler.close()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank3-steps2-3.pt.trace.json"]
    assert step_markers(tmp_path / "profile" / "rank3-steps2-3.pt.trace.json") == {"ProfilerStep#2", "ProfilerStep#3"}
    assert lines == [f"profile: steps 2-3 traced to {tmp_path}/profile/rank*-steps2-3.pt.trace.json (open at "
                     "https://ui.perfetto.dev)"]


def test_a_run_that_stops_inside_the_range_keeps_its_trace(tmp_path):
    profiler = StepProfiler((2, 8), 10, tmp_path, torch.device("cpu"), rank=0, log=lambda line: None)
    fake_steps(profiler, range(1, 5))  # stop_after_steps=4, or a preemption
    profiler.close()
    assert step_markers(tmp_path / "rank0-steps2-4.pt.trace.json") == {f"ProfilerStep#{s}" for s in (2, 3, 4)}


def test_a_resume_inside_the_range_traces_the_rest(tmp_path):
    profiler = StepProfiler((2, 4), 10, tmp_path, torch.device("cpu"), rank=0, log=lambda line: None)
    fake_steps(profiler, range(4, 7))
    assert step_markers(tmp_path / "rank0-steps4-4.pt.trace.json") == {"ProfilerStep#4"}


def test_the_cuda_memory_history_records_python_stacks_only(tmp_path, monkeypatch):
    """C++ stacks, torch's default, are unwound at every allocation, which slows the profiled steps on a GPU."""
    import clustertrain.train.profile as profile_module

    recorded = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *args, **kwargs: recorded.append(kwargs))
    monkeypatch.setattr(profile_module, "profile", FakeProfiler)  # torch's profiler of a GPU, stood in for
    profiler = StepProfiler((1, 2), 5, tmp_path, torch.device("cuda", 0), rank=0)
    profiler.step_started(1)
    assert len(recorded) == 1 and recorded[0]["stacks"] == "python", recorded
    assert recorded[0]["device"] == torch.device("cuda", 0)


class FakeProfiler:
    def __init__(self, **kwargs):
        pass

    def start(self):
        pass
