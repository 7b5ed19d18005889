"""Peak memory is reported per log interval: a large step early in a run does not hide every later one."""

from __future__ import annotations

import torch

from clustertrain.train.memory import PeakMemory


def test_each_interval_reports_its_own_peak():
    peak = PeakMemory(torch.device("cpu"))
    peak.read_and_reset()
    big = torch.ones(100_000_000)  # 0.4 GB, touched: resident
    first = peak.read_and_reset()["mem_gb"]
    del big
    peak.read_and_reset()  # the interval in which it was freed
    later = peak.read_and_reset()["mem_gb"]
    assert first - later > 0.3, (first, later)
