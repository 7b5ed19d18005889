"""What a finished run tells the user (`clustertrain train`'s last lines, tests, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics


@dataclass
class RunSummary:
    """What a finished run tells the user."""

    files: RunDir
    checkpoint: Path | None
    first_loss: float | None = None
    last_loss: float | None = None
    eval_loss: float | None = None
    steps: int = 0
    sample: str | None = None

    def read_curve(self) -> None:
        """The first and last loss of the whole run's curve (across resumes), from its metrics file."""
        curve = [r for r in read_metrics(self.files.metrics) if r.get("loss") is not None]
        self.first_loss = curve[0]["loss"] if curve else None
        self.last_loss = curve[-1]["loss"] if curve else None
