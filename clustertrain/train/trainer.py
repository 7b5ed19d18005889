"""The one training loop, conducted in phases: build, resume, loop, close. The trainer only calls each owner in
order: the config is settled by resolve/, the typed parts (train/parts.py) are built by data/, model/ and
parallel/, checkpoints are checkpoint/manager.py's, and features that watch a run (metrics, trackers, the plan
check, evaluations, the watchdog's phases, profiling, the sample) are observers (train/observers.py) called at
fixed points. Pretraining and fine-tuning differ only by config; nothing here branches on a family or a layout.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed as dist

from clustertrain.checkpoint.manager import CheckpointManager, choose_resume
from clustertrain.config.budget import total_steps
from clustertrain.config.schema import RunConfig
from clustertrain.distributed.env import RankInfo, detect_launcher
from clustertrain.distributed.failures import PeerFailed, first_failure, let_peers_report
from clustertrain.distributed.init import close_distributed, device_type, init_distributed
from clustertrain.distributed.mesh import build_mesh
from clustertrain.distributed.stop import Preempted, StopRequests
from clustertrain.distributed.watchdog import Watchdog
from clustertrain.resolve.epochs import resolve_epochs
from clustertrain.resolve.run import Resolved, resolve
from clustertrain.run_dir import RunDir
from clustertrain.train.announce import start_lines
from clustertrain.train.batches import TrainBatches
from clustertrain.train.lock import RunLock, lock_run_dir
from clustertrain.train.metrics import MetricsLogger
from clustertrain.train.observers import MetricsSink, Observer, Observers, open_metrics, standard_observers
from clustertrain.train.optim import lr_at
from clustertrain.train.parts import (DataParts, ModelParts, Optimization, Place, build_batches, build_checkpoints,
                                      build_data, build_meta_model, build_optimization, lay_out_model)
from clustertrain.train.plan_check import plan_run
from clustertrain.train.status import record_failure, record_hang, write_status
from clustertrain.train.step import NonFiniteSteps, train_step
from clustertrain.train.summary import RunSummary


class Trainer:
    """Builds everything a run needs from a RunConfig and trains it; `observers` join the standard ones at the fixed
    points of train/observers.py: `summary = Trainer(load_config("configs/tiny-llama.yaml")).run()`."""

    # set by build(), in this order
    resolved: Resolved  # the config settled on this world, its layout and snapshot
    planned: dict | None  # rank 0's plan of the run (metrics.plan)
    place: Place
    lock: RunLock | None
    watchdog: Watchdog | None
    data: DataParts
    model: ModelParts
    optim: Optimization
    checkpoints: CheckpointManager | None
    batches: TrainBatches
    observers: Observers | None
    total_steps: int
    # set by start()
    logger: MetricsLogger | None
    summary: RunSummary
    stop_step: int
    non_finite: NonFiniteSteps

    def __init__(self, config: RunConfig, info: RankInfo | None = None, observers: list[Observer] = ()):
        self.config = config  # build() replaces it with its resolved copy, which is only read from then on
        self.info = info or detect_launcher()
        self.files = RunDir(config.run_dir)
        self.extra_observers = list(observers)
        self.step = self.tokens_seen = 0
        self.stop: StopRequests | None = None  # run() listens from the start; start() at the latest
        self.lock = self.watchdog = self.logger = self.checkpoints = self.observers = None
        self.started = self.ended = False  # from start() on, a failure is recorded in status.json

    def build(self) -> None:
        """Settle the config on this world (every problem at once, before the process group starts), then the
        process group, mesh, data, the resume point, the model (meta -> parallelize -> weights), the optimizer
        and the checkpoint manager that tracks them."""
        info = self.info
        self.resolved = run = resolve(self.config, info.world_size, info.local_world_size,
                                      device_type(self.config.parallel))
        cfg = self.config = run.config
        self.planned = (plan_run(run, info.local_world_size) if cfg.metrics.plan and info.rank == 0
                        else None)  # its fake process group goes first
        device = init_distributed(cfg.parallel, info, self.files.root)
        self.lock = lock_run_dir(self.files, dist.get_rank() == 0)  # before the run directory is touched
        self.watchdog = Watchdog(cfg.watchdog, self.files, dist.get_rank(), dist.get_world_size(), self._hung,
                                 nccl=dist.get_backend() == "nccl")
        torch.manual_seed(cfg.train.seed + dist.get_rank())
        self.place = place = Place(info, run.layout, device, build_mesh(run.layout, device.type), dist.get_rank())
        self.watchdog.phase("data preparation")  # no limit: rank 0 reports on its own progress (rank0_first)
        self.data = data = build_data(cfg, place)
        cfg, data.epoch_steps = resolve_epochs(cfg, data.plan, data.loader.stream_ids, data.tokenizer,
                                               self.files.epoch_count, place.rank0)
        self.config = cfg
        self.watchdog.phase("start-up")
        self.total_steps = total_steps(cfg)
        resume_point = choose_resume(self.files, cfg.train.resume, cfg.train.overwrite)
        meta = build_meta_model(cfg, place, data.tokenizer)  # refused here if it cannot fit
        if resume_point.checkpoint is None:  # a resume reads elsewhere
            data.loader.prefetch()  # bad data in the first batch refuses the start before any weight exists
        self.model = model = lay_out_model(cfg, place, meta, run.snapshot)
        self.optim = build_optimization(cfg, model, device)
        self.checkpoints = build_checkpoints(cfg, self.files, self.total_steps, place, data, model, self.optim,
                                             run.snapshot, resume_point, log=self.say)
        self.batches = build_batches(cfg, self.files, place, data, model)
        self.observers = Observers(standard_observers(self) + self.extra_observers)

    def resume(self) -> Path | None:
        """Load the checkpoint chosen at build (train.resume); returns it, or None for a fresh start."""
        state = self.checkpoints.resume(self.config.train)
        if state is not None:
            self.step, self.tokens_seen = state.step, state.tokens_seen
        return self.checkpoints.last if state is not None else None

    def run(self) -> RunSummary:
        """Build, resume, train to the budget (or `train.stop_after_steps`), save; close on every path."""
        # Listen for stop signals from the start: a warning that comes while the model loads is kept for step 1.
        self.stop = StopRequests(self.config.walltime_s, self.config.train.walltime_margin)
        try:
            self.build()
            self.start(self.resume())
            self.train_steps(self.stop_step - self.step)
            return self.finish()
        except Preempted:
            raise
        except (Exception, KeyboardInterrupt, SystemExit) as e:  # never left "running": launchers would wait forever
            if self.watchdog:
                self.watchdog.join_hang()  # a collective broken by a peer that ended for a hang: part of that hang
            vanished = self.watchdog.vanished if self.watchdog else None
            first = None if isinstance(e, KeyboardInterrupt) else first_failure(e, vanished)  # of any rank
            self._end("failed")  # the tracker runs end as failed
            # into status.json only by the lock's holder (rank 0), and never for a refused start (a user error of
            # any rank before start()), which leaves the run directory as it was
            if self.lock is not None and (self.started or first is None or not first.user):
                last = self.checkpoints.last if self.checkpoints else None
                record_failure(self.files, e, first, self.step, last, started=self.started)
            if first is not None and first.rank != self.info.rank:  # this rank stops because another failed first
                raise PeerFailed(first) from None
            raise
        finally:
            self.close()
            let_peers_report()  # rank 0 after a failure: the others learn from the store that it failed first

    def start(self, resumed: Path | None) -> None:
        """Open the run's metrics, say what this run is about to do, and start the observers."""
        cfg, place, rank0 = self.config, self.place, self.place.rank0
        self.started = True
        self.stop = self.stop or StopRequests(cfg.walltime_s, cfg.train.walltime_margin)
        self.logger = open_metrics(self, resumed is not None)
        self.observers.observers.append(MetricsSink(self.logger))  # last: it closes after the others said theirs
        if rank0:
            choice = self.resolved.choice.line if self.resolved.choice else None
            for line in start_lines(cfg, place, self.data, self.model, self.optim, choice, self.total_steps,
                                    self.step, resumed, self.stop.reason):
                self.say(line)
        self.summary = RunSummary(self.files, checkpoint=resumed)
        self._status("running")
        self.stop_step = min(self.total_steps, self.step + (cfg.train.stop_after_steps or self.total_steps))
        self.non_finite = NonFiniteSteps(cfg.train.on_nan, place.device)
        self.observers.on_start(self)
        self.record(self.step, {"load_mem_gb": self.model.load_mem_gb})

    def train_steps(self, n: int) -> None:
        """Run `n` optimizer steps, with logging, evaluation and checkpoints on their schedule."""
        cfg, mesh, optim = self.config, self.place.mesh, self.optim
        for _ in range(n):
            self.observers.on_step_start(self.step + 1)
            for group in optim.optimizer.param_groups:
                group["lr"] = lr_at(self.step, self.total_steps, cfg.optim)
            result = train_step(self.model.runner, optim.optimizer, self.batches.next(self.step + 1),
                                dp_size=mesh.dp_size, dp_group=mesh.dp_group, grad_clip=cfg.optim.grad_clip,
                                scaler=optim.scaler, on_nan=cfg.train.on_nan)
            self.step += 1
            self.tokens_seen += cfg.tokens_per_step
            self.non_finite.record(self.step, result)
            self.observers.on_step_end(self.step, result)  # a log step's metrics among them
            log_step = self.logs(self.step)
            if log_step:
                self.checkpoints.commit_if_done()  # an async save whose write is done; never waits
                self._stop_if_diverged()
            if self._evaluates(self.step):
                self.evaluate()
            if self.step == self.stop_step:
                self._save_last()
            elif self.checkpoints.due(self.step):
                self.save()
            reason = self.stop.agreed(now=log_step)  # between log steps, only every few seconds
            if reason:
                self._save_last()
                self._status("preempted", reason=reason)
                self._end("preempted")
                dist.barrier()  # no rank exits before rank 0 has written everything (srun --kill-on-bad-exit)
                raise Preempted(reason, self.step, self.checkpoints.last)

    def finish(self) -> RunSummary:
        """Save the last step if needed, end the observers (the sample among them), and report the whole run's
        curve (across resumes)."""
        self._save_last()
        outcome = "finished" if self.step >= self.total_steps else "stopped"
        self._status(outcome)
        self.summary.steps, self.summary.checkpoint = self.step, self.checkpoints.last
        if self.batches.audit:
            self.batches.audit.close()
        self._end(outcome)  # flushes metrics.jsonl
        if self.place.rank0:
            self.summary.read_curve()
        return self.summary

    def record(self, step: int, values: dict) -> None:
        """Hand a record of metrics to the observers (the run's metrics files, trackers, ...)."""
        self.observers.on_log(step, values)

    def logs(self, step: int) -> bool:
        """Whether step `step` is a log step: every `metrics.log_every`, the first and the last."""
        return step % self.config.metrics.log_every == 0 or step in (1, self.stop_step)

    def say(self, line: str) -> None:
        """One line to the user (rank 0's console, above the progress bar)."""
        if self.logger is not None:
            self.logger.info(line)

    def _evaluates(self, step: int) -> bool:
        """Whether the run evaluates after step `step`: every `train.eval_every` and at the end, when there is
        held-out data or an eval task."""
        every, cfg = self.config.train.eval_every, self.config.train
        due = every and (step % every == 0 or step == self.total_steps)
        return bool(due and (self.data.plan.has_eval() or (cfg.eval_tasks and self.data.tokenizer is not None)))

    def evaluate(self) -> None:
        """The observers' evaluations (held-out loss, eval tasks), logged; their time is not training time."""
        self.observers.on_eval(self.step)

    def save(self, wait: bool = False, final: bool = False) -> Path | None:
        """Checkpoint the current step (every rank calls; CheckpointManager.save), never a diverged one: the NaN
        check comes first. The time the loop waited for it is logged."""
        self._stop_if_diverged()
        self.observers.on_save(self.step)
        waits = len(self.checkpoints.blocking_s)
        path = self.checkpoints.save(self.step, self.tokens_seen, wait=wait, final=final)
        if len(self.checkpoints.blocking_s) > waits:  # a failed save reports itself
            self.record(self.step, {"checkpoint_blocking_s": self.checkpoints.blocking_s[-1]})
        return path

    def _save_last(self) -> None:
        """The save a run ends with, which must succeed (CheckpointManager.save_last)."""
        if self.checkpoints.saved(self.step):
            self.observers.on_save(self.step)
            self.checkpoints.finalize(final=True)
        else:
            self.save(final=True)

    def _stop_if_diverged(self) -> None:
        """Raise Diverged if `train.on_nan` ends the run here; one host read of a few numbers (all ranks call)."""
        if self.non_finite.ended():
            self.checkpoints.finalize()  # a save in flight is of an earlier, finite step
            raise self.non_finite.error(self.place.mesh.dp_group, self.model.runner.pp_group, self.checkpoints.last,
                                        self.config.optim.lr)

    def _hung(self, report: dict) -> None:
        """The watchdog's report of a hang, by the lowest rank still alive: status.json says so, and rank 0 lets go
        of the run directory (the process ends without unwinding)."""
        record_hang(self.files, report, self.step, getattr(self, "total_steps", None),
                    self.checkpoints.last if self.checkpoints else None)
        if self.lock:
            self.lock.release()

    def _status(self, state: str, **fields) -> None:
        if self.place.rank0:
            checkpoint = self.checkpoints.last
            write_status(self.files, state, step=self.step, total_steps=self.total_steps,
                         checkpoint=str(checkpoint) if checkpoint else None, **fields)

    def _end(self, outcome: str) -> None:
        """The observers' end, once: their files written, the tracker runs ended (as failed, if it failed)."""
        if self.observers is not None and not self.ended:
            self.ended = True
            self.observers.on_end(outcome)

    def close(self) -> None:
        """Release signal handlers, the observers, the model and the process groups, in that order."""
        if self.stop:
            self.stop.close()
        if self.watchdog:
            self.watchdog.phase("closing")
        self._end("closed")  # a run driven step by step (benchmarks) ends here
        # The model goes before the process groups: DDP's reducer must not drop the last reference to a gloo
        # group, whose destructor then joins gloo's threads while holding the GIL they wait for (a hang at exit).
        for name in ("model", "optim", "batches"):
            self.__dict__.pop(name, None)
        self.observers = None
        if self.checkpoints:
            self.checkpoints.tracked = None  # it holds the model too
        gc.collect()
        close_distributed()
        if self.watchdog:
            self.watchdog.close()
        if self.lock:  # last: the files above are closed; a refused start leaves no directory it made
            self.lock.release()
            self.lock = None
