"""Pipeline parallelism, one stage per rank: this rank's stage module, its schedule, and the tied weights
that the first and last stage each hold a copy of.

    stage = parallelize(meta, parallel, mesh, ...)  # with parallel.pp > 1: this rank's PipelineStageModule
    pipeline = Pipeline(stage, parallel, mesh, device, microbatches)
    loss_sum = pipeline.step(batch, dp_size, total_tokens)  # forward and backward of this rank's rows
    pipeline.sync_tied_grads()                               # before clipping

Every stage of a pipeline reads the same rows (ranks that differ only in pp share data); stage 0 feeds
the input ids, the last stage the labels, and only the last stage computes a loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from clustertrain.config.schema import ParallelConfig, RunConfig
from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.dist.mesh import Mesh
from clustertrain.errors import ConfigError
from clustertrain.parallel.stages import PipelineStageModule

# Schedules that run one stage per rank. interleaved_1f1b needs several stages per rank (a list of
# PipelineStage and build_stage over pp × stages-per-rank stages); it goes here once that is wired.
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def check_pipeline(parallel: ParallelConfig, lora: bool) -> None:
    """One-line errors for what pipeline parallelism does not support yet."""
    if parallel.pp_schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {parallel.pp_schedule!r} is not available yet; "
                          f"use one of {sorted(SCHEDULES)}")
    if lora:
        raise ConfigError("lora with parallel.pp > 1 is not available yet; use parallel.pp: 1 for LoRA")
    if parallel.param_dtype == "float16":
        raise ConfigError("parallel.param_dtype = float16 with parallel.pp > 1 is not available yet (loss scaling); "
                          "use bfloat16 or float32")


def pipeline_microbatches(cfg: RunConfig, dp_size: int) -> int:
    """Microbatches per step: parallel.microbatches (default pp), which must divide each rank's rows."""
    per_rank = cfg.train.global_batch_size // dp_size
    count = cfg.parallel.microbatches or cfg.parallel.pp
    if per_rank % count:
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        raise ConfigError(
            f"parallel.microbatches = {count} does not divide the {per_rank} sequences each of the {dp_size} "
            f"data-parallel ranks gets per step (train.global_batch_size = {cfg.train.global_batch_size}); "
            f"use one of {divisors}"
        )
    return count


@torch.no_grad()
def tie_weights_across_stages(stage: PipelineStageModule, mesh: Mesh) -> None:
    """Copy the first stage's embedding into the last stage's head wherever the full model ties them."""
    for head, embedding in stage.tied_names:
        if mesh.is_first_stage:
            dist.send(_local(stage.get_parameter(embedding)), group=mesh.pp_group, group_dst=mesh.pp - 1)
        elif mesh.is_last_stage:
            dist.recv(_local(stage.get_parameter(head)), group=mesh.pp_group, group_src=0)


def scaled_token_loss(logits: torch.Tensor, labels: torch.Tensor, dp_size: int, total_tokens: torch.Tensor):
    """The last stage's loss, as clustertrain.train.step computes it: summed token cross entropy * dp / tokens."""
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum * dp_size / total_tokens


class Pipeline:
    """This rank's stage with its schedule; `module` is what the optimizer and checkpoints see.

    Attributes:
        module: the stage module (FSDP-wrapped when data-parallel), full-model parameter names.
        tied_copies: the last stage's copies of tied weights: clipped, but left out of the norm (the first
            stage's copy counts them once, as the full model does).
    """

    def __init__(self, module: PipelineStageModule, parallel: ParallelConfig, mesh: Mesh, device: torch.device,
                 microbatches: int):
        self.module, self.mesh, self.microbatches = module, mesh, microbatches
        self.stage = PipelineStage(module, mesh.pp_rank, mesh.pp, device, group=mesh.pp_group)
        # scale_grads=False: the loss is already a sum over the global batch divided by its token count.
        self.schedule = SCHEDULES[parallel.pp_schedule](
            self.stage, n_microbatches=microbatches, loss_fn=scaled_token_loss, scale_grads=False
        )
        # this stage's copy of each tied pair: the embedding on the first stage, the head on the last
        names = [embedding if mesh.is_first_stage else head for head, embedding in module.tied_names]
        self._tied = [module.get_parameter(name) for name in names] if mesh.is_first_stage or mesh.is_last_stage else []
        self.tied_copies = self._tied if mesh.is_last_stage else []

    def step(self, batch: dict[str, torch.Tensor], dp_size: int, total_tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's rows through the pipeline.

        Returns:
            the summed token loss on the last stage, 0 on the others.
        """
        return self._run(self.schedule.step, batch, dp_size, total_tokens)

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only: the summed token loss on the last stage, 0 on the others."""
        return self._run(self.schedule.eval, batch, 1, torch.ones((), device=batch["labels"].device))

    def _run(self, run, batch, dp_size, total_tokens) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        inputs = ()
        if self.mesh.is_first_stage:
            ids = batch["input_ids"]
            positions = batch.get("position_ids")
            if positions is None:  # the same as None in the full model; a tensor splits into microbatches
                positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
            inputs = (ids, positions)
        target = batch["labels"] if self.mesh.is_last_stage else None
        run(*inputs, target=target, losses=losses if target is not None else None,
            loss_kwargs={"dp_size": dp_size, "total_tokens": total_tokens})
        if not losses:
            return torch.zeros((), device=batch["labels"].device)
        return torch.stack([loss.detach() for loss in losses]).sum() * total_tokens / dp_size

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of tied copies between the first and last stage, so both take the same update."""
        if not self._tied:
            return
        peer = self.mesh.pp - 1 if self.mesh.is_first_stage else 0
        for param in self._tied:
            grad = _local(param.grad)
            theirs = torch.empty_like(grad)
            ops = [dist.P2POp(dist.isend, grad, group=self.mesh.pp_group, group_peer=peer),
                   dist.P2POp(dist.irecv, theirs, group=self.mesh.pp_group, group_peer=peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            grad += theirs  # the same sum on both stages: addition is commutative in floating point


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece: first and last stage shard a tied pair the same way over the same dp ranks."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
