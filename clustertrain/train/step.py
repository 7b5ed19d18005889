"""One optimizer step: microbatches with gradient accumulation, a global-norm clip, the update.

A step whose global gradient norm is NaN or inf is not applied where that costs nothing (`update`), and is
counted on the device (`NonFiniteSteps`), so that the trainer can stop (or, with `train.on_nan: skip`,
go on) before any checkpoint of a bad state is written, without a host sync per step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor.experimental import implicit_replication

from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.distributed.collectives import all_reduce
from clustertrain.errors import ExitCode, UserError
from clustertrain.parallel.runner import Runner
from clustertrain.train.optim import Optimizers

MAX_SKIPS_IN_A_ROW = 10  # train.on_nan: skip gives up after this many non-finite steps in a row


class Diverged(UserError):
    """The loss or the gradient norm became NaN or inf (train.on_nan): one line, no traceback, exit 3."""

    exit_code = ExitCode.DIVERGED


class OutOfMemory(UserError):
    """A micro-batch needed more memory than the device has (past the start-up check, which is a lower bound)."""


@contextlib.contextmanager
def out_of_memory_named(rows: int, seq_len: int):
    """Turn an allocation failure (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError) into one line that
    names the sizes to lower; the failed step's tensors are freed with the traceback it drops."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        asked = next((line for line in str(e).splitlines() if "allocate" in line), str(e)).strip()[:200]
        raise OutOfMemory(
            f"out of memory in a micro-batch of train.micro_batch_size {rows} x data.seq_len {seq_len:,} tokens "
            f"({asked}); lower either, or set parallel.activation_checkpoint: full"
        ) from None


@dataclass
class StepResult:
    """What a step measured, left on the device: reading it forces a sync, so only log steps do.

    `finite`: whether the global gradient norm was finite (see `update`), None under float16, whose loss
    scaler skips overflowed steps by itself.
    """

    loss_sum: torch.Tensor
    tokens: torch.Tensor
    grad_norm: torch.Tensor
    finite: torch.Tensor | None = None


def loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many of `labels` carry loss (are not IGNORE_INDEX): what a step's and an evaluation's mean divides by."""
    return labels.ne(IGNORE_INDEX).sum()


def count_tokens(batch: dict[str, torch.Tensor], dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Tokens that carry loss in the whole global batch (summed over the data-parallel ranks of `dp_group`)."""
    count = loss_tokens(batch["labels"])
    if dp_group is not None:
        count = all_reduce(count, group=dp_group)
    return count.clamp(min=1)


def train_step(
    runner: Runner,
    optimizer: Optimizers,
    batch: dict[str, torch.Tensor],
    *,
    dp_size: int,
    dp_group: dist.ProcessGroup | None,
    grad_clip: float,
    scaler: ShardedGradScaler | None = None,
    on_nan: str = "stop",
) -> StepResult:
    """Forward/backward this rank's share of a global batch through the runner's parts, clip and update.

    The loss is normalized by the global number of loss tokens, and scaled by `dp_size` because DDP and
    FSDP average gradients over ranks, so every layout computes the gradient of the same global mean.
    Under float16 `scaler` scales the loss up so that small gradients survive, and skips a step whose
    gradients overflowed on any rank (of the world: the other pipeline stages included).

    Returns:
        this rank's summed loss (0 on pipeline stages but the last), the global loss-token count, and the
        global gradient norm before clipping.
    """
    total_tokens = count_tokens(batch, dp_group)
    scale = dp_size / total_tokens
    rows, seq_len = batch["input_ids"].shape
    with out_of_memory_named(rows // runner.microbatches, seq_len):
        local_loss = runner.forward_backward(batch, scaler.scale(scale) if scaler else scale)
    runner.sync_grads()
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(runner.parts, grad_clip, pp_group=runner.pp_group, uncounted=runner.tied_copies)
    finite = update(optimizer, grad_norm, scaler, on_nan)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(local_loss, total_tokens, grad_norm, finite)


def update(optimizer: Optimizers, grad_norm: torch.Tensor,
           scaler: ShardedGradScaler | None, on_nan: str) -> torch.Tensor | None:
    """The optimizer step, not applied when the global gradient norm is NaN or inf.

    Every rank decides alike: the norm is global (reduced over the sharded and pipeline ranks; DDP's
    gradients are averaged before it), and a NaN or inf loss makes the gradients non-finite. Fused AdamW
    skips on the device, given the flag as the float16 scaler gives it (`found_inf`): no host sync. Other
    kernels (foreach) need the flag on the host: one read per step under `on_nan: skip`; under `stop` the
    update is applied, as the run stops at its next check, before any save. Under float16 the scaler skips
    overflowed steps itself (an overflow lowers the scale; it is not a divergence), as before.

    Returns:
        whether the norm was finite, on the device; None under float16.
    """
    if scaler:
        scaler.step(optimizer)  # skipped when a gradient is inf or NaN on any rank
        scaler.update()
        return None
    finite = torch.isfinite(grad_norm)
    if all(getattr(o, "_step_supports_amp_scaling", False) for o in optimizer.optimizers):
        found_inf = (~finite).float()
        for o in optimizer.optimizers:
            o.grad_scale, o.found_inf = None, found_inf
            try:
                o.step()
            finally:
                del o.grad_scale, o.found_inf
    elif on_nan == "stop" or finite.item():
        optimizer.step()
    return finite


class NonFiniteSteps:
    """Non-finite steps, counted on the device each step; `ended()` reads them in one host sync.

    The run ends at the first non-finite step (`train.on_nan: stop`), or at the MAX_SKIPS_IN_A_ROW-th in a
    row (`skip`); the trainer asks at log steps and before every save.
    """

    def __init__(self, on_nan: str, device: torch.device):
        self.on_nan = on_nan
        self.limit = MAX_SKIPS_IN_A_ROW if on_nan == "skip" else 1
        # skipped so far, skipped in a row, then the step that ends the run: its number, loss sum, tokens, norm
        self._state = torch.zeros(6, dtype=torch.float64, device=device)

    def record(self, step: int, result: StepResult) -> None:
        """Count `step` (device ops only)."""
        if result.finite is None:
            return
        state = self._state
        bad = (~result.finite).double()
        in_a_row = (state[1] + 1) * bad
        ends = (in_a_row >= self.limit) & (state[2] == 0)
        found = torch.stack([result.loss_sum.double(), result.tokens.double(), result.grad_norm.double()])
        self._state = torch.cat([torch.stack([state[0] + bad, in_a_row, torch.where(ends, float(step), state[2])]),
                                 torch.where(ends, found, state[3:])])

    def skipped(self) -> int:
        """Steps skipped so far (one host sync)."""
        return int(self._state[0].item())

    def ended(self) -> bool:
        """Whether `train.on_nan` ends the run (one host sync)."""
        return bool(self._state[2].item())

    def error(self, dp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None,
              checkpoint: Path | None, lr: float) -> Diverged:
        """The one line that ends the run; every rank calls it at the same step (the loss is reduced)."""
        skipped, _, step, _, _, norm = self._state.tolist()
        loss = global_mean_loss(StepResult(self._state[3], self._state[4], self._state[5]), dp_group, pp_group)
        step = int(step)
        what = (f"step {step}: the loss ({loss:.4g}) or the gradient norm ({norm:.4g}) is not finite"
                if self.on_nan == "stop" else
                f"steps {step - self.limit + 1}-{step}: {self.limit} steps in a row had a non-finite loss or gradient "
                f"norm (the last: loss {loss:.4g}, gradient norm {norm:.4g}) and were skipped ({int(skipped)} in all)")
        then = f"resume from the last good checkpoint, {checkpoint}" if checkpoint else "start again"
        return Diverged(f"{what}; stopping with nothing saved after it (train.on_nan: {self.on_nan}): lower optim.lr "
                        f"(now {lr:g}) and {then}")


def clip_grad_norm(parts: list[nn.Module], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                   uncounted: list[nn.Parameter] = ()) -> torch.Tensor:
    """Clip to the global norm (sharded gradients reduce across ranks); 0 only measures it.

    Gradients may live on different meshes (tp-split linears on (dp, tp), the rest on dp, or plain
    tensors), and a norm reduces only within one mesh, so each mesh's norm is taken on its own. Under
    pipeline parallelism `parts` are this rank's stages, `pp_group` adds the other ranks' norms,
    and `uncounted` names this rank's copies of weights another stage also holds (tied heads): clipped,
    but counted only once.
    """
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in (p for part in parts for p in part.parameters()):
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    skip = {id(p) for p in uncounted}
    counted = [[p.grad for p in params if id(p) not in skip] for params in by_mesh.values()]
    norms = [torch.nn.utils.get_total_norm(grads, foreach=True) for grads in counted if grads]
    norm = torch.linalg.vector_norm(torch.stack([_full(n) for n in norms]))
    if pp_group is not None:
        norm = all_reduce(norm.square(), group=pp_group).sqrt()
    if max_norm > 0:
        with implicit_replication():  # the plain-tensor norm scales sharded gradients as a replicated scalar
            for params in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def global_mean_loss(result: StepResult, dp_group: dist.ProcessGroup | None,
                     pp_group: dist.ProcessGroup | None = None) -> float:
    """The mean loss over the global batch from each rank's summed loss.

    Under pipeline parallelism only the last stage has a loss (the others hold 0), so `pp_group` brings
    it to every stage.
    """
    total = result.loss_sum
    for group in (dp_group, pp_group):
        if group is not None:
            total = all_reduce(total, group=group)
    return (total / result.tokens.to(total.device)).item()
