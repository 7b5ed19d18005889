"""Pipeline parallelism: this rank's stage modules, their schedule, and the tied weights that the first and
last stage each hold a copy of.

    stages = parallelize(meta, parallel, mesh, ...)  # with parallel.pp > 1: this rank's PipelineStageModules
    pipeline = Pipeline(stages, parallel, mesh, device, microbatches, loss_sum)  # loss_sum(output, labels)
    loss_sum = pipeline.step(batch, dp_size, total_tokens)  # forward and backward of this rank's rows
    pipeline.sync_tied_grads()                               # before clipping

gpipe and 1f1b run one stage per rank; interleaved_1f1b runs `parallel.pp_stages_per_rank`, stage s of
pp × stages-per-rank on rank s % pp (the loop order torch's ScheduleInterleaved1F1B expects). Either way
stage 0 is on pp rank 0 and the last stage on pp rank pp - 1.

Every stage of a pipeline reads the same rows (ranks that differ only in pp share data); stage 0 feeds
the input ids, the last stage the labels, both as the schedule's target and as its head's input, so that
the head can compute the loss without full logits (clustertrain.train.loss); the schedule's loss function
turns that stage's output, the loss or logits, into the scaled loss. Only the last stage has one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from clustertrain.config.checks import INTERLEAVED
from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.mesh import Mesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_indices(parallel: ParallelConfig, pp_rank: int) -> tuple[list[int], int]:
    """The stages this pp rank holds (ascending) and the number of stages in the pipeline."""
    per_rank = parallel.pp_stages_per_rank if parallel.pp_schedule in INTERLEAVED else 1
    num_stages = parallel.pp * per_rank
    return list(range(pp_rank, num_stages, parallel.pp)), num_stages


@torch.no_grad()
def tie_weights_across_stages(stages: list[nn.Module], mesh: Mesh) -> None:
    """Copy the first stage's embedding into the last stage's head wherever the full model ties them."""
    for stage in stages:
        for head, embedding in stage.tied_names:
            if stage.is_first:
                dist.send(_local(stage.get_parameter(embedding)), group=mesh.pp_group, group_dst=mesh.pp - 1)
            elif stage.is_last:
                dist.recv(_local(stage.get_parameter(head)), group=mesh.pp_group, group_src=0)


class Pipeline:
    """This rank's stages with their schedule; `stages` are what the optimizer and checkpoints see.

    Attributes:
        stages: this rank's stage modules (FSDP-wrapped when data-parallel), full-model parameter names,
            in ascending stage order.
        tied_copies: the last stage's copies of tied weights: clipped, but left out of the norm (the first
            stage's copy counts them once, as the full model does).
    """

    def __init__(self, stages: list[nn.Module], parallel: ParallelConfig, mesh: Mesh, device: torch.device,
                 microbatches: int, loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        """`loss_sum(output, labels)`: the summed token loss from the last stage's output (see
        clustertrain.train.loss.output_loss_sum)."""
        self.stages, self.mesh, self.microbatches, self.loss_sum = stages, mesh, microbatches, loss_sum
        pipes = [PipelineStage(m, m.stage_index, m.num_stages, device, group=mesh.pp_group) for m in stages]
        schedule = SCHEDULES[parallel.pp_schedule]
        # scale_grads=False: the loss is already a sum over the global batch divided by its token count.
        self.schedule = schedule(pipes if parallel.pp_schedule in INTERLEAVED else pipes[0],
                                 n_microbatches=microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        # this rank's copy of each tied pair: the embedding on the first stage, the head on the last; frozen
        # (LoRA's base) weights take no gradient
        first = [m.get_parameter(embedding) for m in stages if m.is_first for _, embedding in m.tied_names]
        self.tied_copies = [m.get_parameter(head) for m in stages if m.is_last for head, _ in m.tied_names]
        self._tied = [p for p in first + self.tied_copies if p.requires_grad]

    def step(self, batch: dict[str, torch.Tensor], dp_size: int, total_tokens: torch.Tensor,
             loss_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of this rank's rows through the pipeline; the backward of the loss times
        `loss_scale` (float16's loss scaling) when given.

        Returns:
            the summed token loss on the last stage (unscaled), 0 on the others.
        """
        if loss_scale is not None:  # dividing the token count scales every microbatch's loss alike
            total_tokens = total_tokens / loss_scale
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
        head_inputs = {"labels": target} if target is not None else {}  # a keyword of this rank's stages
        run(*inputs, target=target, losses=losses if target is not None else None,
            loss_kwargs={"dp_size": dp_size, "total_tokens": total_tokens}, **head_inputs)
        if not losses:
            return torch.zeros((), device=batch["labels"].device)
        return torch.stack([loss.detach() for loss in losses]).sum() * total_tokens / dp_size

    def _scaled_loss(self, output: torch.Tensor, labels: torch.Tensor, dp_size: int,
                     total_tokens: torch.Tensor) -> torch.Tensor:
        """A microbatch's loss as train_step scales it: the summed token loss * dp / global tokens."""
        return self.loss_sum(output, labels) * dp_size / total_tokens

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of tied copies between the first and last stage, so both take the same update."""
        if not self._tied:
            return
        peer = self.mesh.pp - 1 if self.mesh.is_first_stage else 0  # stage 0 on pp rank 0, the last on pp - 1
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
