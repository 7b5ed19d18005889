"""Peak memory of one rank, per log interval: what the metrics' `mem_gb` and `mem_reserved_gb` report.

    peak = PeakMemory(device)
    ...                                   # steps
    record |= peak.read_and_reset()       # the peak of those steps only

On a GPU: the caching allocator's peaks of allocated and reserved bytes (reserved is what the process holds
from the device, and what an out-of-memory error compares). On the CPU: the process's peak resident set
size, which Linux resets through /proc/self/clear_refs (elsewhere the peak since the process started).
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # proc(5): "reset the peak resident set size to the process's current value"


def memory_gb(device: torch.device) -> float:
    """Peak allocated memory of this rank since the last reset: the GPU allocator's, or the process's RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return _peak_rss_bytes() / 1e9


class PeakMemory:
    """A rank's peak memory per interval (see the module's docstring)."""

    def __init__(self, device: torch.device):
        self.device = device

    def read_and_reset(self) -> dict[str, float]:
        """The peaks since the last call (or since the process started), then a reset."""
        peaks = {"mem_gb": memory_gb(self.device)}
        if self.device.type == "cuda":
            peaks["mem_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 1e9
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()
        return peaks


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss_bytes() -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; not resettable


def _reset_peak_rss() -> None:
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
    except OSError:  # not Linux, or not allowed: the peak stays the process's
        pass
