"""`metrics.profile: [first, last]`: a torch.profiler trace of those training steps, per rank, in the run folder.

    clustertrain train configs/tiny-llama.yaml --set 'metrics.profile=[5,7]'
    # -> <run_dir>/profile/rank0-steps5-7.pt.trace.json (and rank1-..., one per rank), and on CUDA rank0-memory.pickle

The trainer calls `step_started(step)` before an optimizer step and `step_done(step)` after it (its logging,
evaluation and checkpoint included); every other step costs one comparison. Each profiled step is wrapped in a
`ProfilerStep#<step>` range, the marker TensorBoard's profiler plugin and Perfetto users look for. The trace is a
chrome trace (open it at https://ui.perfetto.dev or chrome://tracing), named `*.pt.trace.json` so that
`tensorboard --logdir <run_dir>/profile` (with torch-tb-profiler) finds it; the CUDA memory snapshot opens at
https://pytorch.org/memory_viz. No collective is involved: every rank writes its own files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from clustertrain.errors import ConfigError

# Allocation events kept by the CUDA memory history: enough for a few steps of a large model, bounded in host memory.
MEMORY_HISTORY_ENTRIES = 100_000


def check_profile_range(steps: tuple[int, int] | None, total_steps: int) -> None:
    """Raise a ConfigError unless `steps` (1-based, inclusive) lies within a run of `total_steps` steps."""
    if steps is None:
        return
    first, last = steps
    shown = f"metrics.profile = [{first}, {last}]"
    if first < 1:
        raise ConfigError(f"{shown}: steps count from 1; the first profiled step must be at least 1")
    if first > last:
        raise ConfigError(f"{shown}: the first step comes after the last; write [first, last]")
    if last > total_steps:
        raise ConfigError(f"{shown}: the run has {total_steps} steps; profile steps within [1, {total_steps}]")


class StepProfiler:
    """Profiles the steps of `metrics.profile` on this rank; does nothing when it is None.

    Args:
        steps: `metrics.profile`, 1-based and inclusive, or None.
        total_steps: optimizer steps of the whole run, to check `steps` against.
        folder: where the files go (`<run_dir>/profile`); created when profiling starts.
        device: this rank's device; CUDA adds GPU activity to the trace and a memory snapshot.
        rank: this rank's global rank, in the file names.
        log: prints one line (a no-op on ranks other than 0) once the files are written.
        with_stack: record Python stacks too (larger traces, slower steps).
    """

    def __init__(self, steps: tuple[int, int] | None, total_steps: int, folder: Path, device: torch.device,
                 rank: int, log: Callable[[str], None] = print, with_stack: bool = False):
        check_profile_range(steps, total_steps)
        self.steps, self.folder, self.device, self.rank, self.log = steps, Path(folder), device, rank, log
        self.with_stack = with_stack
        self._profiler: profile | None = None
        self._marker: record_function | None = None
        self._first_step = 0
        self._last_done = 0
        self.trace: Path | None = None  # the trace file, once written

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"  # ROCm builds report "cuda" too; their profiler is roctracer

    def step_started(self, step: int) -> None:
        """Before optimizer step `step`: start profiling at the range's first step (or a resume inside it)."""
        if self.steps is None or self.trace is not None or not self.steps[0] <= step <= self.steps[1]:
            return
        if self._profiler is None:
            self._start(step)
        self._marker = record_function(f"ProfilerStep#{step}")
        self._marker.__enter__()

    def step_done(self, step: int) -> bool:
        """After optimizer step `step`; returns True when it wrote the files (the step's timing is off then)."""
        if self._marker is None:
            return False
        self._marker.__exit__(None, None, None)
        self._marker = None
        self._last_done = step
        if step < self.steps[1]:
            return False
        self._finish()
        return True

    def close(self) -> None:
        """Write what was recorded when the run ended inside the range (stop_after_steps, preemption, error)."""
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None
        if self._profiler is not None:
            self._finish()

    def _start(self, step: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:  # Python stacks: C++ ones (torch's default) are unwound at every allocation, slowing each step
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=MEMORY_HISTORY_ENTRIES,
                                                     device=self.device)
        self._profiler = profile(activities=activities, record_shapes=True, profile_memory=True,
                                 with_stack=self.with_stack)
        self._profiler.start()
        self._first_step = step

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        if self.cuda:
            torch.cuda.synchronize(self.device)
        profiler.stop()
        last = self._last_done or self._first_step
        span = f"steps{self._first_step}-{last}"
        self.trace = self.folder / f"rank{self.rank}-{span}.pt.trace.json"
        profiler.export_chrome_trace(str(self.trace))
        where = f"{self.folder}/rank*-{span}.pt.trace.json (open at https://ui.perfetto.dev)"
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}-memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            where += f", CUDA memory in {self.folder}/rank*-memory.pickle (open at https://pytorch.org/memory_viz)"
        self.log(f"profile: steps {self._first_step}-{last} traced to {where}")
