"""How a step's batch runs through this rank's model parts: one runner per kind of layout, one interface
(`Runner`).

    runner = parallelize(meta, parallel, mesh, device, blocks, materialize, loss, microbatches)  # a Runner
    loss_sum = runner.forward_backward(batch, scale)  # backward of (summed token loss x scale), every microbatch
    runner.sync_grads()                               # before clipping
    runner.eval_loss_sum(batch)                       # forward only

`runner.parts` are what the optimizer and checkpoints see (full-model parameter names): the model itself for
a `LocalRunner` (one process's whole model, plain, DDP, FSDP or tensor-parallel), this rank's stages for the
pipeline's runner (`clustertrain.parallel.pp.PipelineRunner`). The loss is handed in (`TokenLoss`), so this
layer never imports the training layer; each runner applies the autocast its layout needs, and enters its
`forward_context` (a `ForwardContext`, nothing by default) around each forward and its backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class TokenLoss(Protocol):
    """The summed next-token loss of a batch (clustertrain.model.loss.TOKEN_LOSS)."""

    def model_loss_sum(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                       position_ids: torch.Tensor | None) -> torch.Tensor:
        """Forward a whole model on the rows; their summed token loss."""

    def output_loss_sum(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss from a last pipeline stage's output."""


# The context a forward and its backward run in, given the rows they take: what context parallelism needs (torch's
# context_parallel, which shards the batch's tensors along the sequence in place, so they must be the ones forwarded).
ForwardContext = Callable[[dict[str, torch.Tensor]], contextlib.AbstractContextManager]
ROW_KEYS = ("input_ids", "labels", "position_ids")  # what a forward takes of a batch, split into microbatches by row


def no_context(batch: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
    """The forward context of layouts that need none."""
    return contextlib.nullcontext()


@runtime_checkable
class Runner(Protocol):
    """This rank's model parts as the training step, the evaluation and the trainer drive them.

    Attributes:
        parts: what the optimizer and checkpoints see, under full-model parameter names.
        model: the whole model for the end-of-run sample, or None where no rank holds it (pipelines).
        pp_group: the pipeline's group, over which the loss and the gradient norm are gathered, or None.
        tied_copies: this rank's copies of weights another stage also holds: clipped, but not counted in the norm.
        microbatches: forwards per step, each of an equal share of a rank's rows.
        autocast_dtype: the autocast dtype where no FSDP policy casts, else None.
        forward_context: entered around each forward (and its backward), given the rows it runs: a
            microbatch's, or in a pipeline, whose schedule splits them itself, the rank's rows of the step.
    """

    parts: list[nn.Module]
    model: nn.Module | None
    pp_group: dist.ProcessGroup | None
    tied_copies: list[nn.Parameter]
    microbatches: int
    autocast_dtype: torch.dtype | None
    forward_context: ForwardContext

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        """Backward of every microbatch's summed token loss times `scale`; this rank's loss sum (detached)."""

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only: the summed token loss of the batch."""

    def sync_grads(self) -> None:
        """Whatever gradient sync the backward left to do, before clipping."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast this layout runs its forwards in."""

    def describe(self) -> str:
        """What the runner adds to the start-up line of the layout ("" for none)."""

    def train(self, mode: bool = True) -> None:
        """Set every part to training (or, `mode=False`, evaluation) mode."""


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast in `dtype`, or nothing when the layout casts by itself (FSDP2's policy) or runs fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class LocalRunner:
    """A whole model on each rank: microbatches with gradient accumulation (DDP syncs only the last one).

    Attributes:
        parts: `[model]`, the model as the layout wrapped it.
        model: that model, for the end-of-run sample.
        pp_group: None (no loss or norm to gather from other stages); tied_copies: none.
    """

    pp_group: dist.ProcessGroup | None = None
    tied_copies: list[nn.Parameter] = []

    def __init__(self, model: nn.Module, loss: TokenLoss, microbatches: int, device: torch.device,
                 autocast_dtype: torch.dtype | None, forward_context: ForwardContext = no_context):
        self.model, self.parts = model, [model]
        self.loss, self.microbatches, self.device, self.autocast_dtype = loss, microbatches, device, autocast_dtype
        self.forward_context = forward_context

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        """Backward of each microbatch's summed token loss times `scale`; returns this rank's loss sum (detached)."""
        total = torch.zeros((), device=batch["input_ids"].device)
        for i, micro in enumerate(self._microbatches(batch)):
            last = i == self.microbatches - 1
            sync = self.model.no_sync() if isinstance(self.model, DistributedDataParallel) and not last \
                else contextlib.nullcontext()
            with sync, self.autocast(), self.forward_context(micro):
                loss_sum = self._loss_sum(micro)
                (loss_sum * scale).backward()
            total += loss_sum.detach()
        return total

    def eval_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only: the summed token loss of the batch, in the microbatches of training (the logits of a
        rank's whole share would not fit where training's fit)."""
        total = torch.zeros((), device=batch["input_ids"].device)
        with self.autocast():
            for micro in self._microbatches(batch):
                with self.forward_context(micro):
                    total += self._loss_sum(micro)
        return total

    def _microbatches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        rows = batch["input_ids"].shape[0] // self.microbatches
        return [{key: batch[key][i * rows:(i + 1) * rows] for key in ROW_KEYS if batch.get(key) is not None}
                for i in range(self.microbatches)]

    def _loss_sum(self, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss.model_loss_sum(self.model, micro["input_ids"], micro["labels"], micro.get("position_ids"))

    def sync_grads(self) -> None:
        """Nothing to do: DDP and FSDP reduced the gradients in the backward."""

    def autocast(self):
        return autocast(self.device, self.autocast_dtype)

    def describe(self) -> str:
        return ""

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)
