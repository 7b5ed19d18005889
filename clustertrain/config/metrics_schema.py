"""The `metrics` section: the run's metric sinks (clustertrain/train/metrics.py) and the trackers it logs to
(`metrics.wandb`, `metrics.mlflow`: clustertrain/train/trackers.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from clustertrain.config.section import ConfigPath, Section


class WandbConfig(Section):
    """Weights & Biases (train/trackers.py; `pip install 'clustertrain[wandb]'`): rank 0 logs the config, the plan
    and every metric."""

    enabled: bool = Field(False, description="Log the run to W&B.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: write <dir>/wandb/offline-run-*/ and never touch the network (compute nodes "
        "without one; `wandb sync` uploads it later from a login node); online: stream to the W&B server.")
    project: str = Field("clustertrain", description="The W&B project.")
    entity: str | None = Field(None, description="The W&B team or user (default: the logged-in user's).")
    name: str | None = Field(None, description="The W&B run's display name (default: the run's name).")
    tags: tuple[str, ...] = Field((), description="Tags of the W&B run.")
    dir: ConfigPath | None = Field(None, description="The folder W&B writes its wandb/ folder into (default: the run "
                            "directory).")


class MlflowConfig(Section):
    """MLflow (train/trackers.py; `pip install 'clustertrain[mlflow]'`): rank 0 logs the config and the plan as
    params and artifacts, and every metric."""

    enabled: bool = Field(False, description="Log the run to MLflow.")
    tracking_uri: str | None = Field(
        None, description="The MLflow tracking server or store (default: a file store in <run_dir>/mlruns; "
        "`mlflow ui --backend-store-uri <run_dir>/mlruns` shows it).")
    experiment: str = Field("clustertrain", description="The MLflow experiment (created if missing).")
    run_name: str | None = Field(None, description="The MLflow run's name (default: the run's name).")


class MetricsConfig(Section):
    """What a run logs, where (train/metrics.py), and to which trackers (train/trackers.py)."""

    log_every: int = Field(10, gt=0, description="Log metrics every N steps (and at the first and last step).")
    tensorboard: bool = Field(True, description="Also write TensorBoard event files to <run_dir>/tensorboard.")
    progress: Literal["auto", "bar", "lines", "none"] = Field(
        "auto", description="auto: a progress bar on a terminal, plain lines otherwise (Slurm logs)."
    )
    profile: tuple[int, int] | None = Field(
        None, description="Profile steps [first, last] (1-based, inclusive) with torch.profiler: a trace per rank in "
        "<run_dir>/profile/ (open in Perfetto or TensorBoard) and, on CUDA, a memory snapshot "
        "(open at pytorch.org/memory_viz).",
    )
    peak_flops: float | None = Field(
        None, gt=0, description="Peak FLOP/s per device for MFU; default: known GPUs from a table, CPUs measured."
    )
    plan: bool = Field(True, description="Plan the run at its start (`clustertrain plan`: memory per rank, step "
                       "time) into <run_dir>/plan.json, and print the plan beside what the run measured at its end.")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    tracker_timeout_s: float = Field(
        20, gt=0, allow_inf_nan=False, description="Seconds a tracker (W&B, MLflow) may take for one call (start, "
        "log, close) before it is dropped with one warning. Its calls run off the training thread, which waits for "
        "them only at the end of a start, at most this long (so a preempted run, saved first, still exits inside "
        "Slurm's usual 30 s between SIGTERM and SIGKILL).")
