"""Features that watch a run join it here, at fixed points the trainer calls: adding one never edits the trainer.

    class Losses(Observer):
        def on_log(self, step, record):
            if "loss" in record:
                print(step, record["loss"])

    Trainer(config, observers=[Losses()]).run()      # or add it to `standard_observers` for every run

The points, in a run's order (every rank calls them; an observer that writes files checks `run.place.rank0`):

    on_start(run)            built and resumed, before the first step (`run` is the Trainer: its typed parts)
    on_step_start(step)      before optimizer step `step`
    on_step_end(step, result)   after it (the StepResult stays on the device: read it only when you must)
    on_log(step, record)     a record of metrics (loss, rates, evaluation, memory, ...)
    on_eval(step)            an evaluation (every train.eval_every and at the end): observers that evaluate, do
    on_save(step)            before a checkpoint save
    on_end(outcome)          the run is over: "finished" its budget or "stopped" at train.stop_after_steps (after
                             the last save), "preempted" (saved, to be resumed), "failed", or "closed" (a run
                             driven step by step, as benchmarks do, and closed)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from clustertrain.distributed.faults import delay
from clustertrain.distributed.watchdog import Watchdog
from clustertrain.model.estimate import peak_flops
from clustertrain.parallel.apply import DTYPES
from clustertrain.train.evaluate import evaluate, task_scores
from clustertrain.train.memory import PeakMemory
from clustertrain.train.metrics import MetricsLogger, Throughput
from clustertrain.train.plan_check import StateBytes, compare
from clustertrain.train.profile import StepProfiler
from clustertrain.train.sample import end_of_run_sample
from clustertrain.train.step import global_mean_loss
from clustertrain.train.trackers import open_trackers

if TYPE_CHECKING:
    from clustertrain.checkpoint.manager import CheckpointManager
    from clustertrain.config.schema import RunConfig
    from clustertrain.run_dir import RunDir
    from clustertrain.train.batches import TrainBatches
    from clustertrain.train.parts import DataParts, ModelParts, Optimization, Place
    from clustertrain.train.step import NonFiniteSteps, StepResult
    from clustertrain.train.summary import RunSummary


class Run(Protocol):
    """What an observer reads of a run: its typed parts and where it is (clustertrain.train.trainer.Trainer is one)."""

    config: RunConfig
    files: RunDir
    place: Place
    data: DataParts
    model: ModelParts
    optim: Optimization
    batches: TrainBatches
    checkpoints: CheckpointManager
    non_finite: NonFiniteSteps
    summary: RunSummary
    watchdog: Watchdog
    planned: dict | None
    step: int
    tokens_seen: int
    total_steps: int
    stop_step: int

    def record(self, step: int, values: dict[str, Any]) -> None: ...

    def logs(self, step: int) -> bool: ...

    def say(self, line: str) -> None: ...


ENDED = ("finished", "stopped")  # the outcomes of a run that trained to its end (its budget or stop_after_steps)


class Observer:
    """One feature that watches a run; every point does nothing unless overridden."""

    def on_start(self, run: Run) -> None: ...

    def on_step_start(self, step: int) -> None: ...

    def on_step_end(self, step: int, result: StepResult) -> None: ...

    def on_log(self, step: int, record: dict[str, Any]) -> None: ...

    def on_eval(self, step: int) -> None: ...

    def on_save(self, step: int) -> None: ...

    def on_end(self, outcome: str) -> None: ...


class Observers(Observer):
    """Every observer of a run, called in order at each point; `on_end` reaches all of them even if one fails."""

    def __init__(self, observers: list[Observer]):
        self.observers = observers

    def on_start(self, run: Run) -> None:
        for o in self.observers:
            o.on_start(run)

    def on_step_start(self, step: int) -> None:
        for o in self.observers:
            o.on_step_start(step)

    def on_step_end(self, step: int, result: StepResult) -> None:
        for o in self.observers:
            o.on_step_end(step, result)

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        for o in self.observers:
            o.on_log(step, record)

    def on_eval(self, step: int) -> None:
        for o in self.observers:
            o.on_eval(step)

    def on_save(self, step: int) -> None:
        for o in self.observers:
            o.on_save(step)

    def on_end(self, outcome: str) -> None:
        first: BaseException | None = None
        for o in self.observers:
            try:
                o.on_end(outcome)
            except BaseException as e:  # noqa: BLE001 - the others still end; the first failure is raised
                first = first or e
        if first is not None:
            raise first


def standard_observers(run: Run) -> list[Observer]:
    """The observers every run has, built once its parts are (the run's metrics sink joins at its start: last).
    Step metrics come first: a log step's loss is reduced inside the step's watchdog phase."""
    cfg, files, device = run.config, run.files, run.place.device
    metrics = StepMetrics(cfg.metrics.peak_flops or peak_flops(device, DTYPES[cfg.parallel.param_dtype]))
    observers: list[Observer] = [
        metrics,
        WatchdogPhases(run.watchdog),
        Profiling(StepProfiler(cfg.metrics.profile, run.total_steps, files.profile, run.place.device,
                               run.place.rank, log=run.say), on_trace=metrics.leave_out),
    ]
    if run.data.plan.has_eval():
        observers.append(HeldOutLoss())
    if cfg.train.sample_tokens:
        observers.append(EndSample())
    if cfg.train.eval_tasks and run.data.tokenizer is not None:
        observers.append(EvalTasks(cfg.train.eval_tasks, cfg.train.eval_tasks_limit, cfg.train.seed))
    if run.planned:
        observers.append(PlanCheck(run.planned, run.model.resident_before))
    return observers


class StepMetrics(Observer):
    """A log step's record (`metrics.log_every`, and the first and last step): the loss over every data-parallel
    rank, the learning rate, the gradient norm, tokens/s and MFU, peak memory since the last log step, the loss
    scale, skipped steps, tokens seen and the data's own figures. Time outside training (evaluations, saves,
    profiler traces) is left out of the rates."""

    def __init__(self, peak_flops: float | None):
        self.peak_flops = peak_flops  # of one device: metrics.peak_flops, the datasheet's, or the CPU measured
        self.run: Run | None = None
        self.throughput: Throughput | None = None
        self.peak_memory: PeakMemory | None = None
        self.left_out = False  # something other than training ran since the last step

    def on_start(self, run: Run) -> None:
        self.run, self.peak_memory = run, PeakMemory(run.place.device)
        self.throughput = Throughput(run.step, run.config.tokens_per_step, run.model.flops_per_token,
                                     self.peak_flops, dist.get_world_size())

    def on_step_start(self, step: int) -> None:
        if self.left_out:
            self.throughput.reset(step - 1)
            self.left_out = False

    def on_step_end(self, step: int, result: StepResult) -> None:
        run = self.run
        if not run.logs(step):
            return
        mesh, scaler, skipped = run.place.mesh, run.optim.scaler, run.non_finite.skipped()
        delay("collective", run.place.rank, step)  # a test's fault: this rank late for the loss all-reduce
        run.record(step, {
            "loss": global_mean_loss(result, mesh.dp_group, run.model.runner.pp_group),
            "lr": run.optim.optimizer.param_groups[0]["lr"],
            "grad_norm": result.grad_norm.item(),
            **self.throughput.rates(step),
            **self.peak_memory.read_and_reset(),  # of the steps since the last log line
            **({"loss_scale": scaler.get_scale()} if scaler else {}),
            **({"nan_skipped": skipped} if skipped else {}),
            "tokens": run.tokens_seen,
            **run.batches.metrics(mesh.dp_group),
        })
        self.throughput.reset(step)

    def on_eval(self, step: int) -> None:
        self.leave_out()

    def on_save(self, step: int) -> None:
        self.leave_out()

    def leave_out(self) -> None:
        """Leave the time until the next step out of the rates."""
        self.left_out = True


class WatchdogPhases(Observer):
    """The watchdog's phase clocks follow the run (distributed.watchdog: each phase has its own limit)."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog

    def on_start(self, run: Run) -> None:
        self.watchdog.start_beating()

    def on_step_start(self, step: int) -> None:
        self.watchdog.phase("step" if self.watchdog.step_s else "first step", step)

    def on_step_end(self, step: int, result: StepResult) -> None:
        self.watchdog.step_done()

    def on_eval(self, step: int) -> None:
        self.watchdog.phase("evaluation")

    def on_save(self, step: int) -> None:
        self.watchdog.phase("checkpoint save")


class Profiling(Observer):
    """`metrics.profile`: the steps in its range traced; writing the trace is not counted as training time."""

    def __init__(self, profiler: StepProfiler, on_trace: Callable[[], None]):
        self.profiler, self.on_trace = profiler, on_trace

    def on_step_start(self, step: int) -> None:
        self.profiler.step_started(step)

    def on_step_end(self, step: int, result: StepResult) -> None:
        if self.profiler.step_done(step):
            self.on_trace()

    def on_end(self, outcome: str) -> None:
        self.profiler.close()  # a run that ended inside the profiled range keeps what was traced


class HeldOutLoss(Observer):
    """The held-out loss and perplexity over `train.eval_batches` global batches at every evaluation: the summed
    token loss over the loss tokens of them all (train.evaluate), logged and kept for the run's summary."""

    def on_start(self, run: Run) -> None:
        self.run = run

    def on_eval(self, step: int) -> None:
        run = self.run
        cfg, place = run.config, run.place
        loss = evaluate(run.model.runner, run.data.new_loader("eval", place.mesh), cfg.train.eval_batches,
                        place.layout.grad_accum, place.mesh.dp_group, place.device, cfg.data.packed_documents,
                        run.model.attention)
        run.record(step, {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))})
        run.summary.eval_loss = loss


class EvalTasks(Observer):
    """`train.eval_tasks`: lm-eval scores logged at every evaluation (clustertrain.harness)."""

    def __init__(self, tasks: list[str], limit: int | None, seed: int):
        self.tasks, self.limit, self.seed = tasks, limit, seed
        self.run: Run | None = None

    def on_start(self, run: Run) -> None:
        self.run = run

    def on_eval(self, step: int) -> None:
        run = self.run
        scores = task_scores(run.model.runner, run.place.layout.wrapper == "fsdp", run.data.tokenizer, self.tasks,
                             self.limit, self.seed)
        run.record(step, scores)


class EndSample(Observer):
    """`train.sample_tokens`: a sample of the model at the end of a run that finished its budget (under pipelines,
    a line saying where to sample instead), in the run's summary."""

    def on_start(self, run: Run) -> None:
        self.run = run

    def on_end(self, outcome: str) -> None:
        if outcome not in ENDED:  # never started, or stopped before its end
            return
        run, cfg = self.run, self.run.config.train
        run.watchdog.phase("evaluation")
        run.summary.sample = end_of_run_sample(run.model.runner, run.place.layout.wrapper == "fsdp", run.place.rank0,
                                               run.data.tokenizer, run.data.plan, cfg.sample_prompt,
                                               cfg.sample_tokens, outcome == "finished", run.place.device, run.say,
                                               run.config.run_dir)


class PlanCheck(Observer):
    """`metrics.plan`: the plan made at the start (for this start's world) beside what this start measured, one
    line at its end (rank 0)."""

    def __init__(self, planned: dict, resident_before: int):
        self.planned, self.resident_before = planned, resident_before
        self.run: Run | None = None
        self.state_bytes: StateBytes | None = None
        self.records: list[dict[str, Any]] = []

    def on_start(self, run: Run) -> None:
        self.run = run
        self.state_bytes = StateBytes(run.model.runner.parts, run.optim.optimizer.optimizers)

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        if record.get("loss") is not None:
            self.records.append(record)

    def on_end(self, outcome: str) -> None:
        run = self.run
        if outcome not in ENDED or not run.place.rank0:
            return
        run.say(compare(run.files, self.planned, self.records, self.resident_before, self.state_bytes))


def open_metrics(run: Run, resumed: bool) -> MetricsLogger:
    """The run's metrics from its start (a disabled logger on ranks other than 0): the enabled trackers opened
    (continuing the runs of an earlier start; `resumed`: this start continues a checkpoint), the resolved config
    and the plan written into the run directory, for `data audit` and for people."""
    cfg, files, rank0 = run.config, run.files, run.place.rank0
    config_yaml = run.checkpoints.extras.config_yaml
    trackers = open_trackers(cfg.metrics, files, cfg.name, config_yaml, run.planned, resumed) if rank0 else ()
    logger = MetricsLogger(files, total_steps=run.total_steps, start_step=run.step, enabled=rank0,
                           tensorboard=cfg.metrics.tensorboard, progress=cfg.metrics.progress, trackers=trackers)
    if rank0:
        files.write(files.config, config_yaml)
        if run.planned:
            files.write(files.plan, json.dumps({"plan": run.planned}, indent=1))
        logger.describe(config_yaml, run.planned)
    return logger


class MetricsSink(Observer):
    """The run's metrics (train.metrics.MetricsLogger: progress, metrics.jsonl, TensorBoard, trackers): every
    record written; closed last, the tracker runs ended as failed when the run failed."""

    def __init__(self, logger: MetricsLogger):
        self.logger = logger

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        self.logger.log(step, record)

    def on_end(self, outcome: str) -> None:
        self.logger.close(failed=outcome == "failed")
