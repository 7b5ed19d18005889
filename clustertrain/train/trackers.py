"""W&B and MLflow runs that a training run logs to (rank 0 only): the resolved config and the run's plan when it
starts, every metric as it is logged (named as in TensorBoard: `tag`), and how it ended. A resumed run continues
the same tracker runs: their ids are kept in <run_dir>/trackers.json.

    check_trackers(config.metrics)       # clustertrain.resolve.packages, before the run: one line naming the extra
    trackers = open_trackers(config.metrics, files, config.name, config_yaml, plan, resumed)  # rank 0, files: a RunDir
    MetricsLogger(..., trackers=trackers)                # logs every number to them, and ends them on close

Every tracker call (start, log, close) runs off the training thread (`TrackerThread`), within
metrics.tracker_timeout_s: a tracker that fails, does not answer in time (a server that accepts and never replies)
or falls behind is dropped with one warning; the run trains on at its speed, its signals reach it, and
metrics.jsonl keeps every number. wandb and mlflow are imported only when enabled.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path

import yaml

from clustertrain.config.metrics_schema import MetricsConfig, MlflowConfig, WandbConfig
from clustertrain.errors import one_line
from clustertrain.files import read_json_object
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


class Tracker:
    """One tracker run, opened by its constructor; its calls may raise or stall: `TrackerThread` runs them."""

    key = ""  # its name in trackers.json and in the config (metrics.<key>)
    kind = ""  # its name for people
    line = ""  # where the run is, said once it has opened
    id = ""  # its run id, kept in trackers.json

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        raise NotImplementedError

    def close(self, failed: bool) -> None:
        raise NotImplementedError


_STARTED: weakref.WeakSet[TrackerThread] = weakref.WeakSet()  # every TrackerThread of this process

# Calls a tracker may fall behind (one a log step) before it is dropped: minutes of logging every step.
QUEUE_CALLS = 1000


def stalled() -> bool:
    """Whether a dropped tracker's thread is still inside its call. The interpreter's shutdown would end that daemon
    thread wherever it is, and inside a library's C++ code that aborts the process ("FATAL: exception not
    rethrown", exit -6) after the run has ended well: a process with one ends by os._exit instead."""
    return any(t.dropped and t._thread.is_alive() for t in _STARTED)


class TrackerThread:
    """A tracker off the training thread: its start, logs and close run in order on a daemon thread, fed by a
    bounded queue. The caller never waits, except in `join` at the end, at most `limit_s`.

    A tracker is dropped with one warning when a call fails, when one runs past `limit_s` (seen at the next log
    or at `join`), or when QUEUE_CALLS calls wait. A stalled call stays in its daemon thread: the process does
    not wait for it at exit, and the run's signal handlers, on the main thread, still run.
    """

    def __init__(self, kind: str, opener: Callable[[], Tracker], limit_s: float,
                 on_open: Callable[[Tracker], None] = lambda tracker: None):
        self.kind, self.limit_s = kind, limit_s
        self.dropped = False
        self._calls: queue.Queue = queue.Queue(QUEUE_CALLS)
        self._lines: queue.SimpleQueue = queue.SimpleQueue()  # its start line, for the caller to print
        self._call: tuple[str, float] | None = None  # the call under way: (name, monotonic start)
        self._closing: float | None = None  # when close() was asked
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, args=(opener, on_open), name=f"{kind} tracker",
                                        daemon=True)
        self._thread.start()
        _STARTED.add(self)

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        """Queues one record; never waits."""
        self._check()
        self._put(("log", (step, values, time_s)))

    def close(self, failed: bool) -> None:
        """Queues the end of the tracker run (as failed, with `failed`); `join` waits for it."""
        self._closing = time.monotonic()
        self._put(("close", (failed,)))

    def join(self) -> None:
        """Waits until the closed tracker has done its calls, at most `limit_s` after `close`; drops it past that."""
        end = (self._closing or time.monotonic()) + self.limit_s
        while self._thread.is_alive() and not self.dropped and time.monotonic() < end:
            self._check()
            self._thread.join(0.05)
        if self._thread.is_alive():
            call = self._call
            self._drop(f"did not answer within {self.limit_s:g}s ({call[0] if call else 'close'})")

    def said(self) -> list[str]:
        """The lines the tracker has to say since the last call (where its run is, once open)."""
        lines = []
        while not self._lines.empty():
            lines.append(self._lines.get())
        return lines

    def _put(self, item: tuple) -> None:
        if self.dropped:
            return
        try:
            self._calls.put_nowait(item)
        except queue.Full:
            self._drop(f"fell {QUEUE_CALLS} calls behind")

    def _check(self) -> None:
        call = self._call
        if call is not None and time.monotonic() - call[1] > self.limit_s:
            self._drop(f"did not answer within {self.limit_s:g}s ({call[0]})")

    def _drop(self, why: str) -> None:
        with self._lock:
            if self.dropped:
                return
            self.dropped = True
        log.warning("%s %s; the run goes on without it, metrics.jsonl has every number", self.kind, why)

    def _work(self, opener: Callable[[], Tracker], on_open: Callable[[Tracker], None]) -> None:
        name = "start"
        try:
            tracker = self._timed(name, opener)
            if self.dropped:  # it answered past its limit: already said to be left out
                return
            on_open(tracker)
            self._lines.put(tracker.line)
            while not self.dropped:
                name, args = self._calls.get()
                self._timed(name, getattr(tracker, name), *args)
                if name == "close":
                    return
        except Exception as e:  # noqa: BLE001 - a tracker is a copy of metrics.jsonl: never worth a run
            self._drop(("could not start" if name == "start" else "failed") + f" ({one_line(e)[:200]})")

    def _timed(self, name: str, method: Callable, *args):
        self._call = (name, time.monotonic())
        try:
            return method(*args)
        finally:
            self._call = None


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

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        self.run.log({"step": step, **values})

    def close(self, failed: bool) -> None:
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

    def log(self, step: int, values: dict[str, float], time_s: float) -> None:
        ms = round(time_s * 1000)
        self.client.log_batch(self.id, metrics=[self._metric(_mlflow_name(k), float(v), ms, step)
                                                for k, v in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.id, "FAILED" if failed else "FINISHED")


def open_trackers(metrics: MetricsConfig, files: RunDir, name: str, config_yaml: str, plan: dict | None,
                  resumed: bool = False) -> tuple[TrackerThread, ...]:
    """The enabled trackers, opening on their threads (rank 0, at each start): the runs of an earlier start of
    this run directory continued, their ids kept in trackers.json once open. `config_yaml` is the resolved config;
    `plan` the run's plan (metrics.plan) or None; `resumed`: this start continues a checkpoint, so a tracker with
    no id to continue says that it starts a new tracker run."""
    config = {**yaml.safe_load(config_yaml), **({"plan": plan} if plan else {})}
    try:
        ids = read_json_object(files.trackers)
        why = "has no {} run id"
    except FileNotFoundError:
        ids, why = {}, "is missing"
    except (OSError, ValueError):  # a file that is not ours (not an object, a FIFO): new tracker runs
        ids, why = {}, "cannot be read"
    enabled = [(section, run_class) for section, run_class in ((metrics.wandb, WandbRun), (metrics.mlflow, MlflowRun))
               if section.enabled]
    new = [run_class.kind for _, run_class in enabled if run_class.key not in ids]
    if resumed and new:
        log.warning("%s %s; this resumed run starts a new %s run", files.trackers, why.format(" or ".join(new)),
                    " and ".join(new))
    lock = threading.Lock()

    def keep_id(tracker: Tracker) -> None:
        with lock:  # two trackers may open at once
            ids[tracker.key] = tracker.id
            files.write(files.trackers, json.dumps(ids, indent=1))

    return tuple(TrackerThread(run_class.kind,
                               partial(run_class, section, files, name, config, ids.get(run_class.key)),
                               metrics.tracker_timeout_s, keep_id) for section, run_class in enabled)


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
