"""Metric sinks for the training loop: JSONL, TensorBoard, a console progress display, and the trackers
(W&B, MLflow: train/trackers.py) handed in.

Only rank 0 talks: other ranks build the logger with ``enabled=False`` and every call is a
no-op. ``step`` is the number of completed optimizer steps (1-based), so a run resumed
from a checkpoint at ``start_step`` logs steps ``start_step + 1 ..``. metrics.jsonl keeps the flat keys
(``loss``, ``eval_loss``); TensorBoard and the trackers see them grouped (``train/loss``, ``eval/loss``; `tag`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from clustertrain.files import JsonlWriter, json_value, read_jsonl
from clustertrain.run_dir import RunDir
from clustertrain.train.trackers import TrackerThread, tag

_PROGRESS_MODES = ("auto", "bar", "lines", "none")


def silence(stream: IO[str]) -> None:
    """Point `stream`'s file descriptor at /dev/null after a write to it failed (a closed pipe, a full disk), as
    Python's docs on SIGPIPE advise: its buffered text, later writes and the interpreter's flush at exit then go
    nowhere instead of raising."""
    with contextlib.suppress(OSError, ValueError):  # no descriptor (a StringIO), or already closed
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
        stream.flush()


def print_best_effort(text: str, stream: IO[str]) -> None:
    """`print(text, file=stream)`, flushed, that a closed or full stream silences (see `silence`) instead of failing."""
    try:
        print(text, file=stream, flush=True)
    except OSError:
        silence(stream)


class BestEffortConsole(Console):
    """A rich Console whose output is best-effort: once a write fails (`clustertrain train | head`, a full disk
    under `> log`) it prints nothing more, and the run goes on (metrics.jsonl keeps every line). rich's own
    answer to a closed pipe is SystemExit(1), which would end the run and leave its status "running"."""

    def print(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().print(*args, **kwargs)
        except OSError:
            self.on_broken_pipe()

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence(self.file)


def _si(value: float) -> str:
    """12345 -> '12.3k'."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def format_duration(seconds: float) -> str:
    """80 -> '1m20s', 7500 -> '2h05m', 190000 -> '2d04h'."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


# (metric key, formatter) in display order.
_FIELDS: tuple[tuple[str, Any], ...] = (
    ("loss", lambda v: f"loss {v:.4f}"),
    ("lr", lambda v: f"lr {v:.2e}"),
    ("grad_norm", lambda v: f"gnorm {v:.2f}"),
    ("tokens_per_s", lambda v: f"{_si(v)} tok/s"),
    ("mfu", lambda v: f"mfu {100 * v:.1f}%"),
    ("mem_gb", lambda v: f"mem {v:.2f} GB"),
    ("mem_reserved_gb", lambda v: f"reserved {v:.2f} GB"),
    ("eval_loss", lambda v: f"eval_loss {v:.4f}"),
    ("eval_ppl", lambda v: f"eval_ppl {v:.2f}"),
    ("data_skipped", lambda v: f"skipped {v} bad records"),
    ("checkpoint_blocking_s", lambda v: f"checkpoint blocked {v:.2f}s"),
)
_BAR_KEYS = ("loss", "tokens_per_s")


def format_line(
    step: int,
    total_steps: int,
    metrics: dict[str, Any],
    eta_s: float | None,
    *,
    keys: tuple[str, ...] | None = None,
) -> str:
    """One human line for a log call, e.g. ``step  10/300 | loss 5.1234 | ... | eta 1m20s``.

    Args:
        step: Completed steps.
        total_steps: Steps in the whole run.
        metrics: Metric values; absent or None known keys are skipped, unknown keys ignored.
        eta_s: Seconds to the end of the run, or None (not shown).
        keys: Restrict to these known keys (the progress bar shows fewer).
    """
    width = len(str(total_steps))
    parts = [f"step {step:>{width}}/{total_steps}"]
    for key, fmt in _FIELDS:
        if keys is not None and key not in keys:
            continue
        value = metrics.get(key)
        if value is not None:
            parts.append(fmt(value))
    if keys is None:  # train.eval_tasks' scores, eval_<task>_<metric>
        parts += [f"{k} {v:.4f}" for k, v in metrics.items() if _is_task_score(k, v)]
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def _is_task_score(key: str, value: Any) -> bool:
    return key.startswith("eval_") and key not in ("eval_loss", "eval_ppl") and isinstance(value, (int, float))


def _plain(value: Any) -> Any:
    """Tensors / numpy scalars -> Python numbers, so json and TensorBoard take them."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


LINE_LIMIT = 1 << 20  # bytes of one metrics.jsonl line: a record is a few hundred; past this it is no record
# Metrics that readers compute with (`plot`, `slurm status`, the run's summary): a number or null in every record.
_NUMBERS = frozenset(key for key, _ in _FIELDS) | {"tokens", "tokens_per_s_per_rank", "eta_s", "time"}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file (files.read_jsonl: streamed, a regular file only, as a long run's file may be
    gigabytes); a last line cut short (a run killed mid-write: no newline at its end) is dropped.

    Raises:
        DataError: One line naming the file and line: not a regular file, a line over LINE_LIMIT bytes, not UTF-8
            or not JSON, not an object, a ``step`` that is not a whole number, or a known metric (loss, lr,
            tokens_per_s, ...) that is not a number or null.
    """
    about = "metrics.jsonl holds one JSON object per line, a few hundred bytes each"
    return read_jsonl(Path(path), LINE_LIMIT, about=about, drop_cut_line=True, check=_check_record)


def _check_record(record: dict[str, Any]) -> None:
    step = record.get("step")
    if type(step) is not int or step < 0:
        got = json_value(step) if "step" in record else "missing"
        raise ValueError(f"'step' is {got}; each record needs a whole number of steps >= 0")
    for key in _NUMBERS & record.keys():
        value = record[key]
        if value is not None and not _is_number(value):
            raise ValueError(f"{key!r} is {json_value(value)}; it must be a number or null")


def _is_number(value: Any) -> bool:
    """A JSON number that converts to a float (NaN and infinities included; not a bool, not past 1e308)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


class MetricsLogger:
    """Writes each ``log`` call to ``metrics.jsonl`` (with the wall-clock ``time``), TensorBoard, the
    trackers and the console.

    Args:
        files: The run directory, for ``metrics.jsonl`` and ``tensorboard/``; created if missing.
        total_steps: Steps in the whole run, for the progress display and the ETA.
        start_step: Steps already done (resume); the bar starts there.
        enabled: False on non-zero ranks: nothing is written or printed.
        tensorboard: Also write TensorBoard scalars.
        progress: "auto" (a rich bar on a terminal, plain lines otherwise), "bar",
            "lines" or "none" (no progress output; files and ``info`` lines still go out).
        console: Console to print to (default: a BestEffortConsole on stdout).
        trackers: Trackers (train/trackers.py, each on its own thread) that get every number, grouped (`tag`);
            closed with this, which waits for them at most their time limit.
    """

    def __init__(
        self,
        files: RunDir,
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        tensorboard: bool = True,
        progress: str = "auto",
        console: Console | None = None,
        trackers: tuple[TrackerThread, ...] = (),
    ) -> None:
        if progress not in _PROGRESS_MODES:
            raise ValueError(f"progress must be one of {_PROGRESS_MODES}, got {progress!r}")
        self.enabled = enabled
        self.total_steps = total_steps
        self._start_step = start_step
        self._closed = False
        self._anchor: tuple[float, int] | None = None  # (time, step) of the first log call
        self._eta_s: float | None = None
        self._writer = None
        self._file = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._bar_values: dict[str, Any] = {}
        self.trackers = trackers
        if not enabled:
            return
        files.root.mkdir(parents=True, exist_ok=True)
        self._file = JsonlWriter(files.metrics)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import, only when used

            # purge_step hides events a killed run wrote after the checkpoint we resume from.
            purge = start_step + 1 if start_step > 0 else None
            self._writer = SummaryWriter(log_dir=str(files.tensorboard), purge_step=purge)
        self.console = console if console is not None else BestEffortConsole()
        if progress == "auto":
            progress = "bar" if self.console.is_terminal else "lines"
        self.mode = progress
        if progress == "bar":
            self._progress = Progress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                format_line(start_step, total_steps, {}, None), total=total_steps, completed=start_step
            )
            self._progress.start()

    def _update_eta(self, step: int) -> float | None:
        # Average seconds per step since the first log call: the first step (compilation,
        # warm-up) is excluded, and evals and checkpoints are spread over the steps.
        now = time.perf_counter()
        if self._anchor is None:
            self._anchor = (now, step)
            return None
        t0, s0 = self._anchor
        if step > s0:
            per_step = (now - t0) / (step - s0)
            self._eta_s = max(0, self.total_steps - step) * per_step
        return self._eta_s

    def log(self, step: int, metrics: dict[str, float | int | None]) -> None:
        """Records one set of metrics at ``step``.

        None is written as JSON null; NaN/inf as Python's ``NaN``/``Infinity`` (read back by
        :func:`read_metrics`), so a diverged loss stays visible.
        """
        if not self.enabled or self._closed:
            return
        values = {k: _plain(v) for k, v in metrics.items()}
        eta = self._update_eta(step)
        now = round(time.time(), 3)  # unix seconds to the millisecond, in every sink
        record = {"step": step, "time": now, **values, "eta_s": None if eta is None else round(eta, 1)}
        self._file.append(record)
        numbers = {tag(k): v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._writer is not None:
            for name, value in numbers.items():
                self._writer.add_scalar(name, value, global_step=step, walltime=now)
            self._writer.flush()
        for tracker in self.trackers:
            tracker.log(step, numbers, now)  # queued: never waits
        self._say_trackers()
        if self.mode == "lines":
            self._print(format_line(step, self.total_steps, values, eta))
        elif self._progress is not None:
            # An eval-only call keeps the last train loss and tok/s on the bar.
            self._bar_values.update({k: values[k] for k in _BAR_KEYS if values.get(k) is not None})
            desc = format_line(step, self.total_steps, self._bar_values, eta, keys=_BAR_KEYS)
            self._progress.update(self._task, completed=min(step, self.total_steps), description=desc)
            if any(k.startswith("eval_") and v is not None for k, v in values.items()):
                # Eval results would vanish with the next bar update: keep them as a line.
                self._print(format_line(step, self.total_steps, values, eta))

    def describe(self, config_yaml: str, plan: dict | None) -> None:
        """Puts the run's resolved config (and its plan, where made) into TensorBoard as text, at the first step
        of this start; the trackers got them when they opened."""
        if not self.enabled or self._writer is None:
            return
        step = self._start_step + 1
        self._writer.add_text("config", _markdown_code(config_yaml), global_step=step)
        if plan is not None:
            self._writer.add_text("plan", _markdown_code(json.dumps(plan, indent=1)), global_step=step)
        self._writer.flush()

    def info(self, message: str) -> None:
        """Prints a plain message line (above the progress bar when there is one), unless `--log-level` is above
        its level: warning for a line that starts with `warning:`, else info."""
        level = logging.WARNING if message.startswith("warning:") else logging.INFO
        if self.enabled and not self._closed and level >= logging.getLogger("clustertrain").level:
            self._print(message)

    def _say_trackers(self) -> None:
        # Where each tracker's run is, once it opened (on its own thread, so at a log call or at the end).
        for tracker in self.trackers:
            for line in tracker.said():
                if logging.INFO >= logging.getLogger("clustertrain").level:
                    self._print(line)

    def _print(self, text: str) -> None:
        # soft_wrap: never hard-wrap at the console width (80 columns when not a terminal).
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self, failed: bool = False) -> None:
        """Stops the progress display, flushes and closes the files and ends the tracker runs (as failed, with
        `failed`); idempotent."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        if self._writer is not None:
            self._writer.close()
        self._file.close()
        for tracker in self.trackers:
            tracker.close(failed)
        for tracker in self.trackers:  # together: at most one time limit in all
            tracker.join()
        self._say_trackers()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _markdown_code(text: str) -> str:
    """`text` as a Markdown code block (TensorBoard's text tab renders Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


class Throughput:
    """Tokens/s, per rank and as MFU, over the training steps since the last reset (evaluation, checkpoint and
    trace-writing time are left out by resetting after them).

    MFU = flops_per_token · tokens/s / (peak FLOP/s per rank · ranks) (PaLM, Chowdhery et al. 2022, appendix B).
    """

    def __init__(self, step: int, tokens_per_step: int, flops_per_token: float, peak_flops: float | None,
                 world: int):
        self.tokens_per_step, self.flops_per_token, self.peak_flops, self.world = (tokens_per_step, flops_per_token,
                                                                                   peak_flops, world)
        self.reset(step)

    def reset(self, step: int) -> None:
        self.start, self.start_step = time.perf_counter(), step

    def rates(self, step: int) -> dict[str, float | None]:
        """tokens_per_s, tokens_per_s_per_rank and mfu (None where not measurable) since the last reset."""
        elapsed = time.perf_counter() - self.start
        per_s = self.tokens_per_step * (step - self.start_step) / elapsed if elapsed > 0 else None
        mfu = self.flops_per_token * per_s / (self.peak_flops * self.world) if per_s and self.peak_flops else None
        return {"tokens_per_s": per_s, "tokens_per_s_per_rank": per_s / self.world if per_s else None, "mfu": mfu}
