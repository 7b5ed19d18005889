"""The one training loop, in phases: build, resume, loop, close.

Pretraining and (later) fine-tuning differ only by config; this file never branches on a model family.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.checkpoint.base import base_reference
from clustertrain.checkpoint.manager import CheckpointManager
from clustertrain.config.checks import apply_layout, check_budget_reaches, resolve_layout, total_steps
from clustertrain.config.load import dump_config
from clustertrain.config.schema import RunConfig
from clustertrain.data.audit import AuditLog
from clustertrain.data.loader import StreamLoader
from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import cache_root, load_tokenizer
from clustertrain.distributed.collectives import all_reduce, reduce_values
from clustertrain.distributed.env import RankInfo, detect_launcher
from clustertrain.distributed.failures import PeerFailed, RankFailure, first_failure, let_peers_report
from clustertrain.distributed.init import close_distributed, init_distributed
from clustertrain.distributed.mesh import build_mesh
from clustertrain.distributed.rank0 import rank0_first
from clustertrain.distributed.stop import Preempted, StopRequests
from clustertrain.errors import CheckpointError
from clustertrain.files import write_atomic
from clustertrain.model.attention import resolve_attention, use_documents
from clustertrain.model.estimate import (check_memory_floor, count_params, model_flops_per_token, peak_flops,
                                         training_memory_floor)
from clustertrain.model.kernels import apply_kernels
from clustertrain.model.load import block_classes, build_hf_config, build_meta_model, snapshot_dir
from clustertrain.model.weights import materialize
from clustertrain.parallel.apply import DTYPES, data_parallel_wrapper, parallelize, resolve_param_dtype, unwrap
from clustertrain.parallel.tp import model_shape
from clustertrain.train.lock import RunLock, lock_run_dir
from clustertrain.train.loss import TokenLoss, apply_loss_head, resolve_loss
from clustertrain.train.memory import PeakMemory
from clustertrain.train.metrics import MetricsLogger, read_jsonl
from clustertrain.train.optim import build_optimizer, lr_at
from clustertrain.train.profile import StepProfiler
from clustertrain.train.sample import data_prompt, sample_ids
from clustertrain.train.status import write_status
from clustertrain.train.step import NonFiniteSteps, StepResult, global_mean_loss, out_of_memory_named, train_step


EPOCH_COUNT = "epoch_count.json"  # in the run directory: train.epochs' count of one pass, for later starts


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
        self.config = config
        self.info = info or detect_launcher()
        self.run_dir = config.run_dir
        self.step = 0
        self.tokens_seen = 0
        self.stop: StopRequests | None = None  # run() listens from the start; start() at the latest
        self.lock: RunLock | None = None  # rank 0's hold on the run directory, from build() to close()
        self.started = False  # start() began: from here on a failure is recorded in status.json

    # ---- build -------------------------------------------------------------------------------
    def build(self) -> None:
        """Process group, mesh, data, model (meta -> parallelize -> materialize), optimizer, metrics."""
        cfg = self.config
        # Every problem of this config on this many ranks, at once, before the process group starts.
        self.layout = resolve_layout(cfg, self.info.world_size, self.info.local_world_size,
                                     model_shape(cfg.model, cfg.data.vocab_size))
        self.device = init_distributed(cfg.parallel, self.info, self.run_dir)
        cfg.parallel.param_dtype = resolve_param_dtype(cfg.parallel.param_dtype, self.device.type)
        self.rank0 = dist.get_rank() == 0
        self.lock = lock_run_dir(self.run_dir, self.rank0)  # before anything in the run directory is touched
        torch.manual_seed(cfg.train.seed + dist.get_rank())
        self.mesh = build_mesh(cfg.parallel, self.info, self.device.type)
        assert self.mesh.dp_size == self.layout.dp, "the mesh and the checked layout agree"
        apply_layout(cfg, self.layout)

        self.snapshot = snapshot_dir(cfg.model)
        if cfg.model.path:  # absolute in the run's config.yaml, so adapters exported from it load from anywhere
            cfg.model.path = str(Path(cfg.model.path).resolve())
        if self.snapshot is not None and not cfg.data.tokenizer:
            cfg.data.tokenizer = str(self.snapshot)  # fine-tuning: the model's own tokenizer
        self.tokenizer = rank0_first("preparing the tokenizer", lambda: load_tokenizer(cfg.data))
        self.data_seed = cfg.data_seed
        self.plan = rank0_first("indexing the data sources", lambda: DataPlan(
            cfg.data, self.tokenizer, cfg.train.global_batch_size, self.data_seed, cache_root(cfg.data)
        ))  # rank 0 first: it writes the source indexes the others then read
        self.loader = self._loader("train")
        self.epoch_steps = self._resolve_epochs()
        self.profiler = StepProfiler(cfg.metrics.profile, total_steps(cfg), self.run_dir / "profile", self.device,
                                     dist.get_rank(), log=lambda line: self.logger.info(line))
        self.micro_batch_size, self.microbatches = self.layout.micro_batch, self.layout.grad_accum
        self.audit = AuditLog(self.run_dir / "samples.jsonl", self.plan.labels,
                              self.mesh.dp_rank) if cfg.data.audit else None
        self.mixture: Counter = Counter()

        self.hf_config = build_hf_config(cfg.model, self.tokenizer, cfg.data.vocab_size)
        self.attention = attn = resolve_attention(cfg.model.attn_implementation, self.hf_config, self.device.type,
                                 dtype=DTYPES[cfg.parallel.param_dtype], pipeline=cfg.parallel.pp > 1,
                                 packed_documents=cfg.data.packed_documents)
        meta = build_meta_model(self.hf_config, cfg.lora, DTYPES[cfg.parallel.param_dtype], attn)
        kernels = apply_kernels(meta, cfg.model.kernels, self.device, self.mesh.tp)
        self.loss_kind, loss_note = apply_loss_head(meta, resolve_loss(cfg.train.loss, self.hf_config.vocab_size),
                                                    cfg.train.loss_chunk_tokens, cfg.parallel.compile,
                                                    fused=kernels.linear_cross_entropy)
        self._check_memory(meta)
        self.resume_from = self._checkpoint_to_resume()
        if self.resume_from is None:  # a resume moves the loader elsewhere: its first batch is read then
            self.loader.prefetch()  # bad data in it refuses the start before the model is built
        self.kernel_notes = [note for note in (kernels.note, loss_note) if note]  # said by rank 0 at start
        self.params = count_params(meta)
        self.flops_per_token = model_flops_per_token(meta, cfg.data.seq_len)
        self.runner = parallelize(
            meta, cfg.parallel, self.mesh, self.device, block_classes(meta),
            materialize=lambda m: materialize(m, self.device, cfg.train.seed, self.snapshot),
            loss=TokenLoss(), microbatches=self.microbatches,
        )
        # The largest rank's peak memory once the weights are in place: what loading the model cost.
        self.peak_memory = PeakMemory(self.device)
        self.load_mem_gb, = reduce_values([self.peak_memory.read_and_reset()["mem_gb"]], op="max")
        self.optimizer = build_optimizer(self.runner.parts, cfg.optim,
                                         loss_scaling=cfg.parallel.param_dtype == "float16")
        self.scaler = (ShardedGradScaler(self.device.type, init_scale=cfg.parallel.loss_scale)
                       if cfg.parallel.param_dtype == "float16" else None)
        self.total_steps = total_steps(cfg)
        self.tokens_per_step = cfg.tokens_per_step
        self.peak_flops = cfg.metrics.peak_flops or peak_flops(self.device, DTYPES[cfg.parallel.param_dtype])

    def _resolve_epochs(self) -> int | None:
        """train.epochs given: set train.steps to that many passes over the training data; the steps of one.

        Counting tokenizes the data once, so the count is kept in the run directory for the run's later starts
        (a requeue), as long as the data, its streams and the tokenizer are the same."""
        train = self.config.train
        if train.epochs is None:
            return None
        key = [self.plan.fingerprint(), self.plan.num_streams, str(self.tokenizer.name_or_path), len(self.tokenizer)]
        counted = self.run_dir / EPOCH_COUNT
        per_epoch = _saved_count(counted, key)
        if per_epoch is None:
            if self.rank0:
                print(f"train.epochs = {train.epochs:g}: counting the sequences of one pass over the data", flush=True)
            mine = self.plan.sequences_per_epoch(self.loader.stream_ids)
            per_epoch = int(reduce_values([mine], op="min")[0])
            if self.rank0:
                write_atomic(counted, json.dumps({"key": key, "sequences": per_epoch}))
        train.steps = max(1, math.floor(train.epochs * per_epoch))
        return per_epoch

    def _check_memory(self, meta: torch.nn.Module) -> None:
        """Refuse sizes that cannot fit (a huge batch, sequence or vocabulary) before any of them is allocated."""
        cfg, tokens = self.config, self.micro_batch_size * self.config.data.seq_len
        floor = training_memory_floor(
            meta, rows=self.micro_batch_size, seq_len=cfg.data.seq_len, ranks=dist.get_world_size(),
            logits_tokens=tokens if self.loss_kind == "full" else min(tokens, cfg.train.loss_chunk_tokens),
            activation_bytes=DTYPES[cfg.parallel.param_dtype].itemsize, stages=cfg.parallel.pp, tp=self.mesh.tp,
        )
        check_memory_floor(floor, self.device, "lower train.micro_batch_size or data.seq_len"
                           + (", or use train.loss=chunked" if self.loss_kind == "full" else "")
                           + ", or use a smaller model or more ranks")

    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint resume() loads: train.resume's path, or under auto the run directory's newest complete
        one (the run directory is locked: no other run adds one); None for a fresh start."""
        choice = self.config.train.resume
        if choice == "none":
            return None
        return ckpt.latest_checkpoint(self.run_dir / "checkpoints") if choice == "auto" else Path(choice)

    # ---- resume ------------------------------------------------------------------------------
    def resume(self) -> Path | None:
        """Load the checkpoint that `train.resume` names; returns it, or None for a fresh start."""
        root = self.run_dir / "checkpoints"
        choice = self.config.train.resume
        if self.rank0:
            ckpt.remove_incomplete(root)
        dist.barrier()
        if choice == "none":
            if ckpt.latest_checkpoint(root) and not self.config.train.overwrite:
                raise CheckpointError(
                    f"{self.run_dir} already holds checkpoints and train.resume is 'none'; use --resume auto to "
                    "continue it, --overwrite to start over (the old run is moved aside), or another train.run_dir"
                )
            if ckpt.latest_checkpoint(root):
                dist.barrier()  # every rank has seen the old checkpoints before rank 0 moves them
                if self.rank0:
                    moved = ckpt.move_aside(self.run_dir)
                    print(f"moved the previous run's files to {moved}", flush=True)
            dist.barrier()
            return None
        path = self.resume_from
        if path is None:
            return None
        if not path.is_dir():
            raise CheckpointError(f"train.resume: checkpoint {path} does not exist")
        state = ckpt.load_checkpoint(path, self.runner.parts, self.optimizer, snapshot=self.snapshot)
        check_budget_reaches(self.config.train, self.total_steps, state["step"], path)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        if "data" in state:  # an imported model starts the data from the beginning
            self.loader.load_state_dict(state["data"])
        if self.scaler and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        return path

    def _loader(self, split: str) -> StreamLoader:
        workers = self.config.data.num_workers if split == "train" else 0
        plan, part = self.plan.for_split(split)
        return StreamLoader(plan, self.mesh.dp_rank, self.mesh.dp_size, workers, part)

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
            first = None if isinstance(e, KeyboardInterrupt) else first_failure(e)  # of any rank
            if self._records_failure(first):
                error = f"{type(e).__name__}: {e}" if first is None or first.rank == 0 else str(first)
                if first is None:
                    checkpoint = self.summary.checkpoint if hasattr(self, "summary") else None
                    error = f"interrupted by a second Ctrl-C, without saving (last checkpoint: {checkpoint or 'none'})"
                with contextlib.suppress(OSError):  # the error that matters is `e`
                    write_status(self.run_dir, "failed", step=self.step, error=error)
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
        self.logger = MetricsLogger(
            self.run_dir, total_steps=self.total_steps, start_step=self.step, enabled=self.rank0,
            tensorboard=cfg.metrics.tensorboard, progress=cfg.metrics.progress,
        )
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint, self.total_steps,
                                             self.logger.info, self.device)
        self._announce(resumed)
        if self.stop.reason and self.rank0:
            self.logger.info(f"{self.stop.reason} arrived while the run was starting: it saves and stops after step "
                             f"{self.step + 1}")
        if self.rank0:  # the run's own copy, for `clustertrain data audit` and for people
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.summary = RunSummary(run_dir=self.run_dir, checkpoint=resumed)
        self._status("running")
        self.logger.log(self.step, {"load_mem_gb": self.load_mem_gb})
        self.saved_step = self.step if resumed else None
        self.stop_step = self.total_steps
        if cfg.train.stop_after_steps:
            self.stop_step = min(self.total_steps, self.step + cfg.train.stop_after_steps)
        self.non_finite = NonFiniteSteps(cfg.train.on_nan, self.device)
        self._timer = _Timer(self.step)

    def train_steps(self, n: int) -> None:
        """Run `n` optimizer steps, with logging, evaluation and checkpoints on their schedule."""
        cfg = self.config
        for _ in range(n):
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.step, self.total_steps, cfg.optim)
            self.profiler.step_started(self.step + 1)
            batch = self._next_batch(self.loader)
            result = train_step(self.runner, self.optimizer, batch, dp_size=self.mesh.dp_size,
                                dp_group=self.mesh.dp_group, grad_clip=cfg.optim.grad_clip, scaler=self.scaler,
                                on_nan=cfg.train.on_nan)
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            self.non_finite.record(self.step, result)
            log_step = self.step % cfg.metrics.log_every == 0 or self.step in (1, self.stop_step)
            if log_step:
                self._log(result)
                self._commit(self.checkpoints.commit_if_done())  # an async save whose write is done; never waits
                self._stop_if_diverged()
            if self._eval_due():
                self.summary.eval_loss = self._evaluate()
            if self.step == self.stop_step:
                self._save_last()
            elif self.checkpoints.due(self.step):
                self.save()
            if self.profiler.step_done(self.step):
                self._timer.reset(self.step)  # writing the trace is not training throughput
            reason = self.stop.agreed(now=log_step)  # between log steps, only every few seconds
            if reason:
                self._save_last()
                self._status("preempted", reason=reason)
                self.logger.close()
                dist.barrier()  # no rank exits before rank 0 has written everything (srun --kill-on-bad-exit)
                raise Preempted(reason, self.step, self.summary.checkpoint)

    def _next_batch(self, loader: StreamLoader) -> dict[str, torch.Tensor]:
        """The next batch on the device (copied from pinned memory on a GPU: the host does not wait); position ids
        only when packed documents must not see each other, and then flash-attn gets the documents' lengths as
        the loader found them (no read from the GPU)."""
        batch = loader.next_batch()
        if loader is self.loader:
            self.mixture.update(batch["tokens_by_source"])
            if self.audit:
                self.audit.record(self.step + 1, batch["origins"])
        keys = ["input_ids", "labels"]
        if self.config.data.packed_documents:
            keys.append("position_ids")
        moved = {k: batch[k].to(self.device, non_blocking=True) for k in keys}
        if "position_ids" in moved and self.attention == "flash_attention_2":
            use_documents(moved["position_ids"], batch["cu_seq_lens"],
                          batch["cu_seq_lens"].to(self.device, non_blocking=True))
        return moved

    def _eval_due(self) -> bool:
        every = self.config.train.eval_every
        due = every and (self.step % every == 0 or self.step == self.total_steps)
        return bool(due) and self.plan.has_eval()

    def finish(self) -> RunSummary:
        """Save the last step if needed, sample, and report the whole run's curve (across resumes)."""
        self._save_last()
        self._status("finished" if self.step >= self.total_steps else "stopped")
        summary = self.summary
        summary.steps = self.step
        if self.audit:
            self.audit.close()
        if self.runner.model is None and self.config.train.sample_tokens:
            self.logger.info("train.sample_tokens: no end-of-run sample under parallel.pp > 1; `clustertrain "
                             f"generate {self.run_dir}` samples from the checkpoint")
        elif self.step >= self.total_steps and self.config.train.sample_tokens and self.tokenizer is not None:
            summary.sample = self._sample_or_warn(self.config.train.sample_prompt, self.config.train.sample_tokens)
        self.logger.close()  # flushes metrics.jsonl
        if self.rank0:
            curve = [r for r in read_jsonl(self.run_dir / "metrics.jsonl") if r.get("loss") is not None]
            summary.first_loss = curve[0]["loss"] if curve else None
            summary.last_loss = curve[-1]["loss"] if curve else None
        return summary

    def _log(self, result: StepResult) -> None:
        loss = global_mean_loss(result, self.mesh.dp_group, self.runner.pp_group)
        elapsed, steps = self._timer.elapsed(self.step)
        tokens_per_s = self.tokens_per_step * steps / elapsed if elapsed > 0 else None
        world = dist.get_world_size()
        mfu = None
        skipped = self.non_finite.skipped()
        if tokens_per_s and self.peak_flops:
            mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * world)
        self.logger.log(self.step, {
            "loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": result.grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": tokens_per_s / world if tokens_per_s else None,
            "mfu": mfu,
            **self.peak_memory.read_and_reset(),  # of the steps since the last log line
            **({"loss_scale": self.scaler.get_scale()} if self.scaler else {}),
            **({"nan_skipped": skipped} if skipped else {}),
            "tokens": self.tokens_seen,
            **self._data_metrics(),
        })
        self._timer.reset(self.step)

    def _data_metrics(self) -> dict[str, float]:
        """Realized mixture proportions (share of tokens per source so far) and skipped bad records, global."""
        labels = self.plan.labels
        counts = reduce_values([self.mixture[l] for l in labels] + [sum(self.loader.skipped.values())],
                               group=self.mesh.dp_group)
        total = sum(counts[:-1]) or 1.0
        metrics = {f"mix/{l}": counts[i] / total for i, l in enumerate(labels)} if len(labels) > 1 else {}
        if counts[-1] > 0:
            metrics["data_skipped"] = int(counts[-1])
        return metrics

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Mean loss and perplexity over `train.eval_batches` held-out global batches."""
        self.runner.train(False)
        loader = self._loader("eval")
        totals = torch.zeros(2, device=self.device)
        for _ in range(self.config.train.eval_batches):
            batch = self._next_batch(loader)
            rows, seq_len = batch["input_ids"].shape
            with out_of_memory_named(rows // self.microbatches, seq_len):
                totals[0] += self.runner.eval_loss_sum(batch)
            totals[1] += batch["labels"].ne(IGNORE_INDEX).sum()
        totals = all_reduce(totals, group=self.mesh.dp_group)
        self.runner.train()
        loss = (totals[0] / totals[1]).item()
        self.logger.log(self.step, {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))})
        self._timer.reset(self.step)  # evaluation time is not training throughput
        return loss

    # ---- checkpoint --------------------------------------------------------------------------
    def save(self, wait: bool = False, final: bool = False) -> Path | None:
        """Checkpoint the current step (every rank calls); with async saves it commits later unless `wait`: at the
        first log step after its write is done, else at the next save or the end of the run.

        Never a diverged state: the NaN check comes first. `final`: the run ends with this save, which must
        succeed (CheckpointManager.save).
        """
        self._stop_if_diverged()
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "total_steps": self.total_steps,
            "data": self.loader.state_dict(),  # gathered from every rank: all must call save()
            "world_size": dist.get_world_size(),
            "strategy": self.config.parallel.strategy,
        }
        if self.scaler:
            state["grad_scaler"] = self.scaler.state_dict()
        if self.config.lora.enabled and self.snapshot is not None:  # the checkpoint holds only what trains
            state["base"] = base_reference(self.snapshot)

        def write_extras(folder: Path) -> None:
            (folder / "config.yaml").write_text(dump_config(self.config))
            if self.snapshot is not None:  # the checkpoint stands alone, without the snapshot
                self.hf_config.save_pretrained(folder / "model")
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(folder / "tokenizer")

        blocking = self.checkpoints.blocking_s
        started = len(blocking)
        path = self.checkpoints.save(self.step, self.runner.parts, self.optimizer, state, write_extras, wait=wait,
                                     final=final)
        self.saved_step = self.step
        if len(blocking) > started:  # the time the loop waited for this save (a failed one reports itself)
            self.logger.log(self.step, {"checkpoint_blocking_s": blocking[-1]})
        self._commit(self.checkpoints.last)  # this save if it was waited for, or the previous one it waited for
        self._timer.reset(self.step)
        return path

    def _save_last(self) -> None:
        """The save a run ends with (its budget, `train.stop_after_steps`, a stop signal): it must succeed.

        A failure raises SaveFailed, whatever `checkpoint.on_error` says: the run must not report success.
        """
        if self.saved_step == self.step and self.checkpoints.failed_step != self.step:
            self._commit(self.checkpoints.finalize(final=True))  # saved already, or still writing
        else:
            self.save(final=True)

    def _stop_if_diverged(self) -> None:
        """Raise Diverged if `train.on_nan` ends the run here; one host read of a few numbers (all ranks call)."""
        if self.non_finite.ended():
            self._commit(self.checkpoints.finalize())  # a save in flight is of an earlier, finite step
            raise self.non_finite.error(self.mesh.dp_group, self.runner.pp_group, self.summary.checkpoint,
                                        self.config.optim.lr)

    def _commit(self, path: Path | None) -> None:
        if path is not None:
            self.summary.checkpoint = path

    def _status(self, state: str, **fields) -> None:
        if self.rank0:
            checkpoint = self.summary.checkpoint
            write_status(self.run_dir, state, step=self.step, total_steps=self.total_steps,
                         checkpoint=str(checkpoint) if checkpoint else None, **fields)

    # ---- sample ------------------------------------------------------------------------------
    def _sample_or_warn(self, prompt: str | None, max_new_tokens: int) -> str | None:
        """The end-of-run sample; a failure is one warning line, never a failed run (its checkpoint is saved)."""
        try:
            return self.sample(prompt, max_new_tokens)
        except Exception as e:  # noqa: BLE001 - the run's result is its checkpoint, already complete
            self.logger.info(f"warning: the end-of-run sample failed ({type(e).__name__}: {str(e)[:200]}); the "
                             f"checkpoint is complete, and `clustertrain generate {self.run_dir}` samples from it")
            return None

    @torch.no_grad()
    def sample(self, prompt: str | None, max_new_tokens: int) -> str:
        """A short sampled continuation of `prompt` (top-k 40, temperature 0.8), through the training forward;
        None: of the start of the run's own data (clustertrain.train.sample.data_prompt).

        The model's own forward runs as in training, so every layout's hooks apply (FSDP's unsharding of the
        root's weights included, which HF's and peft's `generate` bypass). Every rank takes part when the
        weights are sharded or split, and rank 0's draw is broadcast, so all ranks run the same forwards;
        under DDP rank 0 samples alone from its full replica.
        """
        together = data_parallel_wrapper(self.config.parallel, self.mesh) == "fsdp"
        if not (together or self.rank0):
            return ""
        model = self.runner.model if together else unwrap(self.runner.model)
        model.eval()
        start = self.tokenizer(prompt).input_ids if prompt is not None else data_prompt(self.plan, self.tokenizer)
        ids = sample_ids(model, start, max_new_tokens, self.tokenizer.eos_token_id, self.device, self.runner.autocast_dtype,
                         together)
        model.train()
        return self.tokenizer.decode(ids[0], skip_special_tokens=True)

    def close(self) -> None:
        """Release signal handlers, metrics files, the model and the process groups, in that order."""
        if self.stop:
            self.stop.close()
        if getattr(self, "profiler", None):
            self.profiler.close()  # a run that ended inside the profiled range keeps what was traced
        if getattr(self, "logger", None):
            self.logger.close()
        # The model goes before the process groups: DDP's reducer must not drop the last reference to a gloo
        # group, whose destructor then joins gloo's threads while holding the GIL they wait for (a hang at exit).
        self.__dict__.pop("runner", None)
        self.__dict__.pop("optimizer", None)
        gc.collect()
        close_distributed()
        if self.lock:  # last: the files above are closed; a refused start leaves no directory it made
            self.lock.release()
            self.lock = None

    def _announce(self, resumed: Path | None) -> None:
        if not self.rank0:
            return
        cfg = self.config
        p = self.params
        self.logger.info(
            f"clustertrain: {self.hf_config.model_type} {p['total'] / 1e6:.2f}M params "  # the family built
            f"({p['trainable'] / 1e6:.2f}M trainable), "
            f"{self.info.world_size} rank(s) on {self.info.world_size // self.info.local_world_size} node(s) "
            f"via {self.info.launcher} on {self.device.type}, "
            f"{cfg.parallel.strategy} (dp_replicate={self.mesh.dp_replicate}, dp_shard={self.mesh.dp_shard}, "
            f"tp={self.mesh.tp}{self.runner.describe()})"
        )
        capped = (f", train.micro_batch_size {cfg.train.micro_batch_size} capped at a rank's share"
                  if cfg.train.micro_batch_size > self.micro_batch_size and cfg.parallel.pp == 1 else "")
        self.logger.info(
            f"batch: {cfg.train.global_batch_size} seq x {cfg.data.seq_len} tokens = {self.tokens_per_step} tokens/step "
            f"({self.mesh.dp_size} ranks x {cfg.train.global_batch_size // self.mesh.dp_size} seq, micro {self.micro_batch_size}"
            f"{capped}); "
            f"{self.total_steps} steps = {self.total_steps * self.tokens_per_step / 1e6:.2f}M tokens"
            f"{f' ({cfg.train.epochs:g} epochs of {self.epoch_steps} steps)' if self.epoch_steps else ''}; "
            f"AdamW {'fused' if self.optimizer.param_groups[0].get('fused') else 'foreach'}, "
            f"{self.attention} attention, {self.loss_kind} loss"
        )
        for note in [*self.kernel_notes, *self.plan.notes]:
            self.logger.info(note)
        if resumed:
            self.logger.info(f"resuming from {resumed} at step {self.step}")
        else:
            self.logger.info(f"starting fresh in {self.run_dir} (no checkpoint to resume)")


class _Timer:
    """Wall time of training steps only: evaluation and checkpoint time are excluded by reset()."""

    def __init__(self, step: int):
        self.reset(step)

    def reset(self, step: int) -> None:
        self.start, self.start_step = time.perf_counter(), step

    def elapsed(self, step: int) -> tuple[float, int]:
        return time.perf_counter() - self.start, step - self.start_step


def _saved_count(path: Path, key: list) -> int | None:
    """The sequences of one epoch that an earlier start of the run counted under `key`, or None."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved.get("sequences") if isinstance(saved, dict) and saved.get("key") == key else None
