"""Pipeline parallelism: this rank's stage modules, their schedule, and the tied weights that the first and
last stage each hold a copy of.

    pipeline = parallelize(meta, parallel, mesh, ...)  # with parallel.pp > 1: this rank's stages, as a runner
    loss_sum = pipeline.forward_backward(batch, scale)  # forward and backward of this rank's rows
    pipeline.sync_grads()                               # tied copies' gradients summed, before clipping

gpipe and 1f1b run one stage per rank; interleaved_1f1b runs `parallel.pp_stages_per_rank`, stage s of
pp × stages-per-rank on rank s % pp (the loop order torch's ScheduleInterleaved1F1B expects). Either way
stage 0 is on pp rank 0 and the last stage on pp rank pp - 1.

Every stage of a pipeline reads the same rows (ranks that differ only in pp share data); stage 0 feeds
the input ids, the last stage the labels, both as the schedule's target and as its head's input, so that
the head can compute the loss without full logits (clustertrain.model.loss); the schedule's loss function
turns that stage's output, the loss or logits, into the scaled loss. Only the last stage has one.

`PipelineRunner` is the runner of these layouts (a clustertrain.parallel.runner.Runner).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from clustertrain.config.layout import INTERLEAVED
from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.collectives import all_reduce
from clustertrain.distributed.mesh import Mesh
from clustertrain.parallel.runner import ForwardContext, TokenLoss, autocast, no_context

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_indices(parallel: ParallelConfig, mesh: Mesh) -> tuple[list[int], int]:
    """The stages this rank holds (ascending) and the number of stages in the pipeline."""
    pp = mesh.degree("pp")
    per_rank = parallel.pp_stages_per_rank if parallel.pp_schedule in INTERLEAVED else 1
    return list(range(mesh.pp_rank, pp * per_rank, pp)), pp * per_rank


@torch.no_grad()
def tie_weights_across_stages(stages: list[nn.Module], mesh: Mesh) -> None:
    """Copy the first stage's embedding into the last stage's head wherever the full model ties them."""
    for stage in stages:
        for head, embedding in stage.tied_names:
            if stage.is_first:
                last = mesh.degree("pp") - 1  # the pp rank of the last stage
                dist.send(_local(stage.get_parameter(embedding)), group=mesh.pp_group, group_dst=last)
            elif stage.is_last:
                dist.recv(_local(stage.get_parameter(head)), group=mesh.pp_group, group_src=0)


class PipelineRunner:
    """This rank's stages with their schedule: the Runner of pipeline layouts (clustertrain.parallel.runner).

    Attributes:
        parts: this rank's stage modules (FSDP-wrapped when data-parallel), full-model parameter names,
            in ascending stage order.
        model: None: no stage holds the whole model (the end-of-run sample needs it).
        pp_group: the pipeline's group, over which the last stage's loss and every stage's norm are gathered.
        tied_copies: the last stage's copies of tied weights: clipped, but left out of the norm (the first
            stage's copy counts them once, as the full model does).
    """

    model = None

    def __init__(self, stages: list[nn.Module], parallel: ParallelConfig, mesh: Mesh, device: torch.device,
                 microbatches: int, loss: TokenLoss, autocast_dtype: torch.dtype | None,
                 forward_context: ForwardContext = no_context):
        self.parts, self.mesh, self.microbatches, self.loss = stages, mesh, microbatches, loss
        self.forward_context = forward_context  # around a whole step: the schedule splits the rows itself
        self.device, self.autocast_dtype, self.pp_group = device, autocast_dtype, mesh.pp_group
        self.schedule_name = parallel.pp_schedule
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

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's rows through the pipeline: the backward of every microbatch's
        summed token loss times `scale`.

        Returns:
            the summed token loss on the last stage, 0 on the others.
        """
        with self.autocast(), self.forward_context(batch):
            return self._run(self.schedule.step, batch, scale)

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only: the summed token loss of the batch, on every stage (the last stage's, shared)."""
        with self.autocast(), self.forward_context(batch):
            loss = self._run(self.schedule.eval, batch, torch.ones((), device=batch["labels"].device))
        return all_reduce(loss, group=self.pp_group)

    def autocast(self):
        return autocast(self.device, self.autocast_dtype)

    def describe(self) -> str:
        return (f", pp={self.mesh.degree('pp')} {self.schedule_name} x {self.microbatches} microbatches, "
                f"{len(self.parts)} stage(s) per rank")

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def _run(self, run, batch, scale) -> torch.Tensor:
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
        run(*inputs, target=target, losses=losses if target is not None else None, loss_kwargs={"scale": scale},
            **head_inputs)
        if not losses:
            return torch.zeros((), device=batch["labels"].device)
        return torch.stack([loss.detach() for loss in losses]).sum() / scale

    def _scaled_loss(self, output: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A microbatch's summed token loss times `scale` (a local runner's backward does the same)."""
        return self.loss.output_loss_sum(output, labels) * scale

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the gradients of tied copies between the first and last stage, so both take the same update."""
        if not self._tied:
            return
        # stage 0 is on pp rank 0, the last stage on pp rank pp - 1
        peer = self.mesh.degree("pp") - 1 if self.mesh.is_first_stage else 0
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
