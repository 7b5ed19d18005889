"""The `metrics.wandb` and `metrics.mlflow` sections: the trackers a run logs to (clustertrain/train/trackers.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from clustertrain.config.section import Section


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
    dir: str | None = Field(None, description="The folder W&B writes its wandb/ folder into (default: the run "
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
