"""W&B and MLflow runs that a training run logs to (rank 0 only): the resolved config and the run's plan when it
starts, every metric as it is logged (named as in TensorBoard: `tag`), and how it ended. A resumed run continues
the same tracker runs: their ids are kept in <run_dir>/trackers.json.

    check_trackers(config.metrics)       # before the run: a missing package is one line naming the extra
    trackers = open_trackers(config.metrics, RunDir(run_dir), config.name, config_yaml, plan)   # rank 0, at start
    MetricsLogger(..., trackers=trackers)                # logs every number to them, and ends them on close

wandb and mlflow are imported only when enabled. A tracker that fails (a server gone) says so once and is dropped:
the run trains on, and metrics.jsonl keeps every number.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path

import yaml

from clustertrain.config.schema import MetricsConfig
from clustertrain.config.tracker_schema import MlflowConfig, WandbConfig
from clustertrain.errors import ConfigError
from clustertrain.run_dir import RunDir

log = logging.getLogger(__name__)

# The TensorBoard/tracker name of a metrics.jsonl key where it is not train/<key> (see `tag`).
_TAGS = {
    "tokens_per_s": "perf/tokens_per_s", "tokens_per_s_per_rank": "perf/tokens_per_s_per_rank", "mfu": "perf/mfu",
    "mem_gb": "perf/mem_gb", "mem_reserved_gb": "perf/mem_reserved_gb", "load_mem_gb": "perf/load_mem_gb",
    "checkpoint_blocking_s": "perf/checkpoint_blocking_s", "data_skipped": "data/skipped",
}


def tag(key: str) -> str:
    """The grouped name of metrics.jsonl key `key` in TensorBoard, W&B and MLflow: 'loss' -> 'train/loss',
    'eval_loss' -> 'eval/loss', 'mfu' -> 'perf/mfu', 'mix/web' -> 'data/mix/web'."""
    if key in _TAGS:
        return _TAGS[key]
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    if key.startswith("mix/"):
        return "data/" + key
    return "train/" + key


def check_trackers(metrics: MetricsConfig) -> None:
    """Raises ConfigError (one line naming the extra to install) if an enabled tracker's package is missing."""
    for section, module in ((metrics.wandb, "wandb"), (metrics.mlflow, "mlflow")):
        if section.enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.{module}.enabled needs {module}, which is not installed: "
                              f"pip install 'clustertrain[{module}]'")


class Tracker:
    """One tracker run: `log` and `close` never raise; the first failure is printed and ends its logging."""

    key = ""  # its name in trackers.json and in the config (metrics.<key>)
    kind = ""  # its name for people
    line = ""  # where the run is, for the start lines
    done = False  # closed, or failed

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        self._guarded(self._log, step, values, time_s)

    def close(self, failed: bool) -> None:
        self._guarded(self._close, failed)
        self.done = True

    def _guarded(self, method, *args) -> None:
        if self.done:
            return
        try:
            method(*args)
        except Exception as e:  # noqa: BLE001 - a tracker is a copy of metrics.jsonl: never worth a run
            self.done = True
            log.warning("%s failed (%s); the run goes on without it, metrics.jsonl has every number", self.kind,
                        " ".join(str(e).split())[:200])

    def _log(self, step: int, values: dict[str, float], time_s: float) -> None:
        raise NotImplementedError

    def _close(self, failed: bool) -> None:
        raise NotImplementedError


class WandbRun(Tracker):
    """A W&B run, offline by default: <dir>/wandb/offline-run-<time>-<id>/, one per start, all under one id that
    `wandb sync` joins into one run. Our step is the x-axis ("step"), so steps a restart does again are kept."""

    key, kind = "wandb", "W&B"

    def __init__(self, settings: WandbConfig, files: RunDir, name: str, config: dict, run_id: str | None):
        import wandb

        folder = Path(settings.dir or files.root)
        folder.mkdir(parents=True, exist_ok=True)  # W&B would fall back to a temporary folder
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, name=settings.name or name, tags=list(settings.tags),
            id=run_id, resume="allow", mode=settings.mode, dir=str(folder),
            settings=wandb.Settings(console="off", silent=True),  # no capture of our output, no banner in it
        )
        self.run.config.update(config, allow_val_change=True)  # a resume may change values (train.steps)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.id = self.run.id
        self.line = (f"W&B: offline run {self.id} in {folder / 'wandb'} (upload it later: wandb sync "
                     f"{folder / 'wandb'}/offline-run-*)"
                     if settings.mode == "offline" else f"W&B: {self.run.url}")

    def _log(self, step: int, values: dict[str, float], time_s: float) -> None:
        self.run.log({"step": step, **values})

    def _close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowRun(Tracker):
    """An MLflow run, in a local file store under the run directory unless `tracking_uri` names another: the config
    and plan as params (flattened: `optim.lr`, `plan.peak_bytes`) and as artifacts, every metric at its step."""

    key, kind = "mlflow", "MLflow"

    def __init__(self, settings: MlflowConfig, files: RunDir, name: str, config: dict, run_id: str | None):
        uri = settings.tracking_uri or files.mlruns.resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks; skinny has no database store
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.client, self._metric = MlflowClient(tracking_uri=uri), Metric
        run = self._existing(run_id)
        if run is None:
            experiment = self.client.get_experiment_by_name(settings.experiment)
            experiment_id = (experiment.experiment_id if experiment else
                             self.client.create_experiment(settings.experiment))
            run = self.client.create_run(experiment_id, run_name=settings.run_name or name)
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.id = run.info.run_id
        logged = run.data.params  # params cannot change: a resume adds only new ones; the artifacts are the latest
        params = [Param(k, v) for k, v in _flat(config).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow's most per call
            self.client.log_batch(self.id, params=params[i:i + 100])
        self.client.log_text(self.id, yaml.safe_dump({k: v for k, v in config.items() if k != "plan"},
                                                     sort_keys=False), "config.yaml")
        if config.get("plan"):
            self.client.log_text(self.id, json.dumps(config["plan"], indent=1), "plan.json")
        self.line = f"MLflow: run {self.id} in {uri}"

    def _existing(self, run_id: str | None):
        if run_id is None:
            return None
        try:
            return self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - gone (a new store): start a new run
            return None

    def _log(self, step: int, values: dict[str, float], time_s: float) -> None:
        ms = round(time_s * 1000)
        self.client.log_batch(self.id, metrics=[self._metric(_mlflow_name(k), float(v), ms, step)
                                                for k, v in values.items()])

    def _close(self, failed: bool) -> None:
        self.client.set_terminated(self.id, "FAILED" if failed else "FINISHED")


def open_trackers(metrics: MetricsConfig, files: RunDir, name: str, config_yaml: str, plan: dict | None
                  ) -> tuple[Tracker, ...]:
    """The enabled trackers' runs, opened (rank 0, at each start): the one of an earlier start of this run
    directory continued, its id kept in trackers.json. `config_yaml` is the resolved config; `plan` the run's plan
    (metrics.plan) or None. A tracker that cannot open says why and is left out."""
    config = {**yaml.safe_load(config_yaml), **({"plan": plan} if plan else {})}
    try:
        ids = json.loads(files.trackers.read_text())
    except (OSError, ValueError):
        ids = {}
    ids = ids if isinstance(ids, dict) else {}  # a file that is not ours: new tracker runs
    opened = []
    for section, run_class in ((metrics.wandb, WandbRun), (metrics.mlflow, MlflowRun)):
        if not section.enabled:
            continue
        try:
            tracker = run_class(section, files, name, config, ids.get(run_class.key))
        except Exception as e:  # noqa: BLE001 - as a failed log: the run trains without it
            log.warning("%s could not start (%s); the run goes on without it", run_class.kind,
                        " ".join(str(e).split())[:200])
            continue
        ids[run_class.key] = tracker.id
        opened.append(tracker)
    if opened:
        files.write(files.trackers, json.dumps(ids, indent=1))
    return tuple(opened)


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 0.001}} -> {"optim.lr": "0.001"}; lists and long values as text (MLflow keeps 500)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            flat[_mlflow_name(f"{prefix}{key}")] = text[:500]
    return flat


def _mlflow_name(name: str) -> str:
    """MLflow takes letters, digits, `_-. /` in names: anything else (a source label's `:`) becomes `_`."""
    return re.sub(r"[^\w\-. /]", "_", name)
