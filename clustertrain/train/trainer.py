"""The one training loop, conducted in phases: build, resume, loop, close.

Each concern has its owner; the trainer only calls them in order: the config is resolved once
(train/resolve.py), the data comes from data/, the model is built by model/build.py on the meta device and laid
out by parallel/apply.py, the checkpoints are chosen, loaded and saved by checkpoint/manager.py, and the run
directory's names are clustertrain/run_dir.py's. Pretraining and fine-tuning differ only by config; this file
never branches on a model family or a layout.
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from clustertrain.checkpoint.manager import CheckpointManager, StandAlone, Tracked
from clustertrain.config.checks import check_budget_reaches, total_steps
from clustertrain.config.load import dump_config
from clustertrain.config.schema import RunConfig
from clustertrain.data.audit import AuditLog
from clustertrain.data.loader import StreamLoader
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import cache_root, load_tokenizer
from clustertrain.distributed.collectives import reduce_values
from clustertrain.distributed.env import RankInfo, detect_launcher
from clustertrain.distributed.failures import PeerFailed, RankFailure, first_failure, let_peers_report
from clustertrain.distributed.init import close_distributed, device_type, init_distributed
from clustertrain.distributed.mesh import build_mesh
from clustertrain.distributed.rank0 import rank0_first
from clustertrain.distributed.faults import delay
from clustertrain.distributed.stop import Preempted, StopRequests
from clustertrain.distributed.watchdog import Watchdog
from clustertrain.harness import check_tasks
from clustertrain.model.build import block_classes, build_model
from clustertrain.model.estimate import check_training_memory, count_params, model_flops_per_token, peak_flops
from clustertrain.model.loss import TokenLoss
from clustertrain.model.weights import materialize
from clustertrain.parallel.apply import DTYPES, parallelize
from clustertrain.run_dir import RunDir
from clustertrain.train.announce import start_lines
from clustertrain.train.batches import TrainBatches
from clustertrain.train.evaluate import evaluate, task_scores
from clustertrain.train.lock import RunLock, lock_run_dir
from clustertrain.train.memory import PeakMemory, resident_bytes
from clustertrain.train.metrics import MetricsLogger, Throughput, read_jsonl
from clustertrain.train.plan_check import StateBytes, compare, plan_run
from clustertrain.train.optim import build_optimizer, lr_at
from clustertrain.train.profile import StepProfiler
from clustertrain.train.resolve import resolve_epochs, resolve_run
from clustertrain.train.sample import end_of_run_sample
from clustertrain.train.status import record_failure, write_status
from clustertrain.train.step import NonFiniteSteps, StepResult, global_mean_loss, train_step
from clustertrain.train.trackers import open_trackers


@dataclass
class RunSummary:
    """What a finished run tells the user."""

    run_dir: Path
    checkpoint: Path | None
    first_loss: float | None = None
    last_loss: float | None = None
    eval_loss: float | None = None
    steps: int = 0
    sample: str | None = None


class Trainer:
    """Builds everything a run needs from a RunConfig and trains it.

    Example:
        >>> summary = Trainer(load_config("configs/tiny-llama.yaml")).run()
    """

    def __init__(self, config: RunConfig, info: RankInfo | None = None):
        self.config = config  # build() replaces it with its resolved copy, which is only read from then on
        self.info = info or detect_launcher()
        self.run_dir = config.run_dir
        self.files = RunDir(config.run_dir)
        self.step = 0
        self.tokens_seen = 0
        self.stop: StopRequests | None = None  # run() listens from the start; start() at the latest
        self.lock: RunLock | None = None  # rank 0's hold on the run directory, from build() to close()
        self.planned: dict | None = None  # rank 0's plan of the run (metrics.plan)
        self.watchdog: Watchdog | None = None  # every rank's, from the run directory's lock to close()
        self.started = False  # start() began: from here on a failure is recorded in status.json

    # ---- build -------------------------------------------------------------------------------
    def build(self) -> None:
        """Resolve the config on this world (every problem at once, before the process group starts), then
        the process group, mesh, data, model (meta -> parallelize -> materialize), optimizer and checkpoints."""
        run = resolve_run(self.config, self.info.world_size, self.info.local_world_size,
                          device_type(self.config.parallel))
        self.config, self.layout, self.snapshot, self.layout_choice = run.config, run.layout, run.snapshot, run.choice
        cfg, layout = self.config, self.layout
        if cfg.metrics.plan and self.info.rank == 0:  # a fake process group first: before the real one
            self.planned = plan_run(cfg, layout.world_size, self.info.local_world_size, device_type(cfg.parallel))
        self.device = init_distributed(cfg.parallel, self.info, self.run_dir)
        self.rank0 = dist.get_rank() == 0
        self.lock = lock_run_dir(self.run_dir, self.rank0)  # before anything in the run directory is touched
        self.watchdog = Watchdog(cfg.watchdog, self.files, dist.get_rank(), dist.get_world_size(), self._hung,
                                 nccl=dist.get_backend() == "nccl")
        torch.manual_seed(cfg.train.seed + dist.get_rank())
        self.mesh = build_mesh(layout, self.device.type)
        self.watchdog.phase("data preparation")  # no limit: rank 0 reports on its own progress (rank0_first)
        self.tokenizer = rank0_first("preparing the tokenizer", lambda: load_tokenizer(cfg.data))
        if cfg.train.eval_tasks and self.tokenizer is not None:  # a task that cannot run fails now, not at step N
            rank0_first("checking train.eval_tasks",
                        lambda: self.rank0 and check_tasks(cfg.train.eval_tasks, self.tokenizer))
        self.plan = rank0_first("indexing the data sources", lambda: DataPlan(
            cfg.data, self.tokenizer, cfg.train.global_batch_size, cfg.data_seed, cache_root(cfg.data)
        ))  # rank 0 first: it writes the source indexes the others then read
        self.loader = self._loader("train")
        cfg, self.epoch_steps = resolve_epochs(cfg, self.plan, self.loader.stream_ids, self.tokenizer,
                                               self.files.epoch_count, self.rank0)
        self.config = cfg
        self.watchdog.phase("start-up")
        self.total_steps, self.tokens_per_step = total_steps(cfg), cfg.tokens_per_step
        meta = self._build_model()
        self.checkpoints = CheckpointManager(
            self.files, cfg.checkpoint, self.total_steps, self.device,
            StandAlone(dump_config(cfg), self.hf_config, self.tokenizer, self.snapshot,
                       adapters_only=cfg.lora.enabled and self.snapshot is not None, strategy=cfg.parallel.strategy),
            log=lambda line: self.logger.info(line))
        if self.checkpoints.choose(cfg.train.resume, cfg.train.overwrite) is None:  # a resume reads elsewhere
            self.loader.prefetch()  # bad data in the first batch refuses the start before the model is built
        self.baseline_bytes = resident_bytes() if self.device.type == "cpu" else 0  # what the model adds to
        self.runner = parallelize(
            meta, cfg.parallel, self.mesh, self.device, block_classes(meta),
            materialize=lambda m: materialize(m, self.device, cfg.train.seed, self.snapshot),
            loss=TokenLoss(), microbatches=layout.grad_accum,
        )
        self.peak_memory = PeakMemory(self.device)  # the largest rank's peak once the weights are in: loading's
        self.load_mem_gb, = reduce_values([self.peak_memory.read_and_reset()["mem_gb"]], op="max")
        self.optimizer = build_optimizer(self.runner.parts, cfg.optim, loss_scaling=cfg.parallel.param_dtype == "float16")
        self.state_bytes = StateBytes(self.runner.parts, self.optimizer.optimizers) if self.planned else None
        self.scaler = (ShardedGradScaler(self.device.type, init_scale=cfg.parallel.loss_scale)
                       if cfg.parallel.param_dtype == "float16" else None)
        self.checkpoints.tracked = Tracked(self.runner.parts, self.optimizer, self.loader, self.scaler)
        self.peak_flops = cfg.metrics.peak_flops or peak_flops(self.device, DTYPES[cfg.parallel.param_dtype])
        self.profiler = StepProfiler(cfg.metrics.profile, self.total_steps, self.files.profile, self.device,
                                     dist.get_rank(), log=lambda line: self.logger.info(line))
        audit = AuditLog(self.files.samples, self.plan.labels, self.mesh.dp_rank) if cfg.data.audit else None
        self.batches = TrainBatches(self.loader, self.plan.labels, self.device, cfg.data.packed_documents,
                                    self.attention, audit)

    def _build_model(self) -> torch.nn.Module:
        """The model on the meta device with its kernels and loss head, refused if it cannot fit."""
        cfg, layout, dtype = self.config, self.layout, DTYPES[self.config.parallel.param_dtype]
        built = build_model(cfg.model, cfg.lora, self.tokenizer, cfg.data.vocab_size, param_dtype=dtype,
                            device=self.device, loss=cfg.train.loss, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                            compile=cfg.parallel.compile, tp=layout.tp, pipeline=layout.pp > 1,
                            packed_documents=cfg.data.packed_documents)
        self.hf_config, self.attention, self.loss_kind, self.kernel_notes = (built.hf_config, built.attention,
                                                                             built.loss, built.notes)
        check_training_memory(built.model, self.device, rows=layout.micro_batch, seq_len=cfg.data.seq_len,
                              full_logits=self.loss_kind == "full", chunk_tokens=cfg.train.loss_chunk_tokens,
                              activation_bytes=dtype.itemsize, ranks=layout.world_size, stages=layout.pp, tp=layout.tp)
        self.params = count_params(built.model)
        self.flops_per_token = model_flops_per_token(built.model, cfg.data.seq_len)
        return built.model

    def _loader(self, split: str) -> StreamLoader:
        workers = self.config.data.num_workers if split == "train" else 0
        plan, part = self.plan.for_split(split)
        return StreamLoader(plan, self.mesh.dp_rank, self.mesh.dp_size, workers, part)

    # ---- resume ------------------------------------------------------------------------------
    def resume(self) -> Path | None:
        """Load the checkpoint the manager chose (train.resume); returns it, or None for a fresh start."""
        state = self.checkpoints.resume()
        if state is None:
            return None
        check_budget_reaches(self.config.train, self.total_steps, state.step, self.checkpoints.chosen)
        self.step, self.tokens_seen = state.step, state.tokens_seen
        return self.checkpoints.chosen

    # ---- loop --------------------------------------------------------------------------------
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
            if getattr(self, "logger", None):
                self.logger.close(failed=True)  # the tracker runs end as failed
            if self._records_failure(first):
                checkpoints = getattr(self, "checkpoints", None)
                record_failure(self.run_dir, e, first, self.step, checkpoints.last if checkpoints else None,
                               started=self.started)
            if first is not None and first.rank != self.info.rank:  # this rank stops because another failed first
                raise PeerFailed(first) from None
            raise
        finally:
            self.close()
            let_peers_report()  # rank 0 after a failure: the others learn from the store that it failed first

    def _records_failure(self, first: RankFailure | None) -> bool:
        """Whether the failure goes into status.json: only by the lock's holder (rank 0), and never for a start
        that was refused (a user error of any rank before start()), which leaves the run directory as it was."""
        return self.lock is not None and (self.started or first is None or not first.user)

    def start(self, resumed: Path | None) -> None:
        """Open the metrics sinks and say what this run is about to do."""
        cfg = self.config
        self.started = True
        self.stop = self.stop or StopRequests(cfg.walltime_s, cfg.train.walltime_margin)
        config_yaml = self.checkpoints.extras.config_yaml
        trackers = (open_trackers(cfg.metrics, self.files, cfg.name, config_yaml, self.planned, resumed is not None)
                    if self.rank0 else ())
        self.logger = MetricsLogger(self.run_dir, total_steps=self.total_steps, start_step=self.step,
                                    enabled=self.rank0, tensorboard=cfg.metrics.tensorboard,
                                    progress=cfg.metrics.progress, trackers=trackers)
        if self.rank0:
            for line in start_lines(self, resumed):
                self.logger.info(line)
            self.files.write(self.files.config, config_yaml)  # for `data audit`, for people
            if self.planned:
                self.files.write(self.files.plan, json.dumps({"plan": self.planned}, indent=1))
            self.logger.describe(config_yaml, self.planned)
        self.summary = RunSummary(run_dir=self.run_dir, checkpoint=resumed)
        self._status("running")
        self.watchdog.start_beating()
        self.logger.log(self.step, {"load_mem_gb": self.load_mem_gb})
        self.stop_step = min(self.total_steps, self.step + (cfg.train.stop_after_steps or self.total_steps))
        self.non_finite = NonFiniteSteps(cfg.train.on_nan, self.device)
        self.throughput = Throughput(self.step, self.tokens_per_step, self.flops_per_token, self.peak_flops,
                                     dist.get_world_size())

    def train_steps(self, n: int) -> None:
        """Run `n` optimizer steps, with logging, evaluation and checkpoints on their schedule."""
        cfg = self.config
        for _ in range(n):
            self.watchdog.phase("step" if self.watchdog.step_s else "first step", self.step + 1)
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.step, self.total_steps, cfg.optim)
            self.profiler.step_started(self.step + 1)
            result = train_step(self.runner, self.optimizer, self.batches.next(self.step + 1),
                                dp_size=self.mesh.dp_size, dp_group=self.mesh.dp_group, grad_clip=cfg.optim.grad_clip,
                                scaler=self.scaler, on_nan=cfg.train.on_nan)
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            self.non_finite.record(self.step, result)
            log_step = self.step % cfg.metrics.log_every == 0 or self.step in (1, self.stop_step)
            if log_step:
                self._log(result)
                self.checkpoints.commit_if_done()  # an async save whose write is done; never waits
                self._stop_if_diverged()
            self.watchdog.step_done()
            every = cfg.train.eval_every
            if every and (self.step % every == 0 or self.step == self.total_steps) and self._evaluates():
                self._evaluate()
            if self.step == self.stop_step:
                self._save_last()
            elif self.checkpoints.due(self.step):
                self.save()
            if self.profiler.step_done(self.step):
                self.throughput.reset(self.step)  # writing the trace is not training throughput
            reason = self.stop.agreed(now=log_step)  # between log steps, only every few seconds
            if reason:
                self._save_last()
                self._status("preempted", reason=reason)
                self.logger.close()
                dist.barrier()  # no rank exits before rank 0 has written everything (srun --kill-on-bad-exit)
                raise Preempted(reason, self.step, self.checkpoints.last)

    def finish(self) -> RunSummary:
        """Save the last step if needed, sample, and report the whole run's curve (across resumes)."""
        cfg, summary = self.config.train, self.summary
        self._save_last()
        self._status("finished" if self.step >= self.total_steps else "stopped")
        summary.steps, summary.checkpoint = self.step, self.checkpoints.last
        if self.batches.audit:
            self.batches.audit.close()
        self.watchdog.phase("evaluation")
        summary.sample = end_of_run_sample(self.runner, self.layout.wrapper == "fsdp", self.rank0, self.tokenizer,
                                           self.plan, cfg.sample_prompt, cfg.sample_tokens,
                                           self.step >= self.total_steps, self.device, self.logger.info, self.run_dir)
        self.logger.close()  # flushes metrics.jsonl
        if self.rank0:
            curve = [r for r in read_jsonl(self.files.metrics) if r.get("loss") is not None]
            summary.first_loss = curve[0]["loss"] if curve else None
            summary.last_loss = curve[-1]["loss"] if curve else None
            if self.planned:
                print(compare(self.files, self.planned, curve, self.baseline_bytes, self.state_bytes), flush=True)
        return summary

    def _log(self, result: StepResult) -> None:
        skipped = self.non_finite.skipped()
        delay("collective", dist.get_rank(), self.step)  # a test's fault: this rank late for the loss all-reduce
        self.logger.log(self.step, {
            "loss": global_mean_loss(result, self.mesh.dp_group, self.runner.pp_group),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": result.grad_norm.item(),
            **self.throughput.rates(self.step),
            **self.peak_memory.read_and_reset(),  # of the steps since the last log line
            **({"loss_scale": self.scaler.get_scale()} if self.scaler else {}),
            **({"nan_skipped": skipped} if skipped else {}),
            "tokens": self.tokens_seen,
            **self.batches.metrics(self.mesh.dp_group),
        })
        self.throughput.reset(self.step)

    def _evaluates(self) -> bool:
        return self.plan.has_eval() or bool(self.config.train.eval_tasks and self.tokenizer is not None)

    def _evaluate(self) -> float | None:
        """Held-out loss and perplexity over `train.eval_batches` global batches, and the scores of
        `train.eval_tasks`, logged; time not counted. Returns the held-out loss, if there is held-out data."""
        cfg, loss = self.config, None
        self.watchdog.phase("evaluation")
        if self.plan.has_eval():
            loss = evaluate(self.runner, self._loader("eval"), cfg.train.eval_batches, self.layout.grad_accum,
                            self.mesh.dp_group, self.device, cfg.data.packed_documents, self.attention)
            self.logger.log(self.step, {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))})
            self.summary.eval_loss = loss
        if cfg.train.eval_tasks and self.tokenizer is not None:
            self.logger.log(self.step, task_scores(self.runner, self.layout.wrapper == "fsdp", self.tokenizer,
                                                   cfg.train.eval_tasks, cfg.train.eval_tasks_limit, cfg.train.seed))
        self.throughput.reset(self.step)  # evaluation time is not training throughput
        return loss

    # ---- checkpoint --------------------------------------------------------------------------
    def save(self, wait: bool = False, final: bool = False) -> Path | None:
        """Checkpoint the current step (every rank calls; CheckpointManager.save), never a diverged one: the NaN
        check comes first. The time the loop waited for it is logged."""
        self._stop_if_diverged()
        self.watchdog.phase("checkpoint save")
        waits = len(self.checkpoints.blocking_s)
        path = self.checkpoints.save(self.step, self.tokens_seen, wait=wait, final=final)
        if len(self.checkpoints.blocking_s) > waits:  # a failed save reports itself
            self.logger.log(self.step, {"checkpoint_blocking_s": self.checkpoints.blocking_s[-1]})
        self.throughput.reset(self.step)
        return path

    def _save_last(self) -> None:
        """The save a run ends with, which must succeed (CheckpointManager.save_last)."""
        if self.checkpoints.saved(self.step):
            self.watchdog.phase("checkpoint save")
            self.checkpoints.finalize(final=True)
        else:
            self.save(final=True)

    def _stop_if_diverged(self) -> None:
        """Raise Diverged if `train.on_nan` ends the run here; one host read of a few numbers (all ranks call)."""
        if self.non_finite.ended():
            self.checkpoints.finalize()  # a save in flight is of an earlier, finite step
            raise self.non_finite.error(self.mesh.dp_group, self.runner.pp_group, self.checkpoints.last,
                                        self.config.optim.lr)

    def _hung(self, report: dict) -> None:
        """The watchdog's report of a hang, by the lowest rank still alive: status.json says so, and rank 0 lets go
        of the run directory (the process ends without unwinding)."""
        checkpoints = getattr(self, "checkpoints", None)
        last = checkpoints.last if checkpoints else None
        write_status(self.run_dir, "hung", step=self.step, total_steps=getattr(self, "total_steps", None),
                     checkpoint=str(last) if last else None, error=report["line"],
                     **{k: report[k] for k in ("stuck_ranks", "stuck_hosts", "phase")})
        if self.lock:
            self.lock.release()

    def _status(self, state: str, **fields) -> None:
        if self.rank0:
            checkpoint = self.checkpoints.last
            write_status(self.run_dir, state, step=self.step, total_steps=self.total_steps,
                         checkpoint=str(checkpoint) if checkpoint else None, **fields)

    def close(self) -> None:
        """Release signal handlers, metrics files, the model and the process groups, in that order."""
        if self.stop:
            self.stop.close()
        if self.watchdog:
            self.watchdog.phase("closing")
        if getattr(self, "profiler", None):
            self.profiler.close()  # a run that ended inside the profiled range keeps what was traced
        if getattr(self, "logger", None):
            self.logger.close()
        # The model goes before the process groups: DDP's reducer must not drop the last reference to a gloo
        # group, whose destructor then joins gloo's threads while holding the GIL they wait for (a hang at exit).
        for name in ("runner", "optimizer"):
            self.__dict__.pop(name, None)
        if getattr(self, "checkpoints", None):
            self.checkpoints.tracked = None  # it holds the model too
        gc.collect()
        close_distributed()
        if self.watchdog:
            self.watchdog.close()
        if self.lock:  # last: the files above are closed; a refused start leaves no directory it made
            self.lock.release()
            self.lock = None
