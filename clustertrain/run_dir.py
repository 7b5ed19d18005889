"""The one owner of a run directory's layout: every name a run keeps in `<run_dir>/`, and who writes it.

    run = RunDir(config.run_dir)
    run.status                      # runs/tiny-llama/status.json
    run.write(run.config, text)     # whole or not at all (files.write_atomic)
    read_json_object(run.status)    # a regular file of at most 1 MiB, never blocking (files.read_regular)

What lies inside a checkpoint folder (`checkpoints/step-N/`: weights, train state, its own config.yaml,
tokenizer/) is the checkpoint's layout, owned by clustertrain/checkpoint/. README.md's "The run directory"
lists these names; tests/unit/test_run_dir.py keeps the two in step.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from clustertrain.files import write_atomic

_SCALING_RUN = re.compile(r"scaling-N(\d+)")


@dataclass(frozen=True)
class RunDir:
    """The paths of the run directory `root`; nothing is created or read until a caller does."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:  # the trainer (rank 0) at each start: the resolved config; `data audit` replays it
        return self.root / "config.yaml"

    @property
    def lock(self) -> Path:  # train/lock.py (rank 0) while a run trains here: its holder
        return self.root / "run.lock"

    @property
    def status(self) -> Path:  # train/status.py (rank 0): running, preempted, finished or failed; launchers read it
        return self.root / "status.json"

    @property
    def metrics(self) -> Path:  # train/metrics.MetricsLogger (rank 0): one JSON object per logged step
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:  # train/metrics.MetricsLogger (rank 0): the same scalars as TensorBoard events
        return self.root / "tensorboard"

    @property
    def trackers(self) -> Path:  # train/trackers.py (rank 0), with metrics.wandb/mlflow: the run ids a resume continues
        return self.root / "trackers.json"

    @property
    def wandb(self) -> Path:  # W&B (rank 0), with metrics.wandb and no metrics.wandb.dir: its offline-run-* folders
        return self.root / "wandb"

    @property
    def mlruns(self) -> Path:  # MLflow (rank 0), with metrics.mlflow and no tracking_uri: its local file store
        return self.root / "mlruns"

    @property
    def samples(self) -> Path:  # data/audit.AuditLog (rank 0), with data.audit: every global batch's samples
        return self.root / "samples.jsonl"

    @property
    def epoch_count(self) -> Path:  # the trainer (rank 0), with train.epochs: one pass's count, for later starts
        return self.root / "epoch_count.json"

    @property
    def plan(self) -> Path:  # train/plan_check.py (rank 0), with metrics.plan: the plan, then what the run measured
        return self.root / "plan.json"

    @property
    def heartbeats(self) -> Path:  # distributed/watchdog.py (every rank): rank-NNNNN.json, its step, phase and time
        return self.root / "heartbeats"

    def heartbeat(self, rank: int) -> Path:
        """Rank `rank`'s heartbeat file (distributed/watchdog.py)."""
        return self.heartbeats / f"rank-{rank:05d}.json"

    @property
    def hang(self) -> Path:  # distributed/watchdog.py on a hang: report.json and each live rank's stacks
        return self.root / "hang"

    @property
    def hang_report(self) -> Path:  # distributed/watchdog.py: the stuck rank and phase, and the stack files
        return self.hang / "report.json"

    @property
    def hang_began(self) -> Path:  # distributed/watchdog.py: which rank declared this launch's hang, and when
        return self.hang / "began.json"

    def hang_stacks(self, rank: int) -> Path:
        """Rank `rank`'s Python stacks (every thread) at a hang; flight-rank-N.pkl beside it on NCCL."""
        return self.hang / f"rank-{rank:05d}.txt"

    @property
    def doctor(self) -> Path:  # `clustertrain doctor --output` (rank 0; the job step of slurm.doctor): its findings
        return self.root / "doctor.json"

    @property
    def checkpoints(self) -> Path:  # checkpoint/ (every rank writes, rank 0 publishes): step-N/ folders
        return self.root / "checkpoints"

    @property
    def profile(self) -> Path:  # train/profile.StepProfiler (every rank), with metrics.profile: traces
        return self.root / "profile"

    @property
    def curves_plot(self) -> Path:  # `clustertrain plot` (train/plots.py) by default: loss, lr, speed, MFU, memory
        return self.root / "curves.png"

    @property
    def scaling_plot(self) -> Path:  # `clustertrain slurm scaling` by default: a scaling study's tokens/s
        return self.root / "scaling.png"

    @property
    def slurm(self) -> Path:  # launch/jobs.py and the job script: everything of the run's Slurm jobs
        return self.root / "slurm"

    @property
    def slurm_config(self) -> Path:  # launch/jobs.submit: the config snapshot the job script trains
        return self.slurm / "config.yaml"

    @property
    def job_script(self) -> Path:  # launch/jobs.submit: the batch script, sbatch'ed again by a follow-up job
        return self.slurm / "job.sh"

    @property
    def job_chain(self) -> Path:  # launch/jobs.record (submit, job-start, job-end): one event per line
        return self.slurm / "jobs.jsonl"

    @property
    def user_error_note(self) -> Path:  # errors.note_user_error in a job's ranks; cleared by job-start, read by job-end
        return self.slurm / "user-error.txt"

    def job_log(self, job_id: str) -> Path:
        """Slurm's log of job `job_id` (sbatch --output, by default; "%j" gives the pattern sbatch fills in)."""
        return self.slurm / f"{job_id}.out"

    def scaling_run(self, nodes: int) -> Path:
        """The run directory of a scaling study's run at `nodes` nodes (launch/scaling.py)."""
        return self.root / f"scaling-N{nodes}"

    def scaling_runs(self) -> list[int]:
        """The node counts of the scaling study's runs under this directory, ascending."""
        return sorted(int(m[1]) for p in self.root.glob("scaling-N*") if (m := _SCALING_RUN.fullmatch(p.name)))

    def replaced(self, stamp: str) -> Path:
        """Where `--overwrite` moves an earlier run's files (`moved_aside`), `stamp` its time."""
        return self.root / f"replaced-{stamp}"

    @property
    def moved_aside(self) -> tuple[Path, ...]:
        """What a start-over moves into `replaced(stamp)`: the earlier run's checkpoints, logs and config."""
        return (self.checkpoints, self.metrics, self.samples, self.tensorboard, self.config, self.trackers, self.wandb,
                self.mlruns)

    def move_aside(self) -> Path:
        """Move an earlier run's files (`moved_aside`) into `replaced(<time>)`: starting over loses nothing."""
        target = self.replaced(time.strftime("%Y%m%d-%H%M%S"))
        target.mkdir(parents=True)
        for path in self.moved_aside:
            if path.exists():
                os.replace(path, target / path.name)
        return target

    def write(self, path: Path, data: str | bytes) -> Path:
        """Write one of this run's files so that no reader or crash sees half of it (files.write_atomic), its
        folder made first; returns `path`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
        return path
