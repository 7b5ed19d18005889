"""AdamW with decay groups, and the learning-rate schedule as a pure function of the step."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.optimizer import _default_to_fused_or_foreach  # torch's own choice, given use_fused

from clustertrain.config.schema import OptimConfig
from clustertrain.errors import ConfigError


class Optimizers:
    """One AdamW per model part, used as one optimizer (param_groups, step, zero_grad).

    Checkpoints need one optimizer per module (torch's `get_state_dict(module, optimizer)`), and a pipeline
    rank holds several stage modules under interleaved schedules; a whole model is one part.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def build_optimizer(parts: list[nn.Module], optim: OptimConfig, loss_scaling: bool = False) -> Optimizers:
    """AdamW over each part's trainable parameters: matrices decay, vectors (norms, biases) do not (as in nanoGPT)."""
    return Optimizers([_adamw(part, optim, loss_scaling) for part in parts])


def _adamw(model: nn.Module, optim: OptimConfig, loss_scaling: bool) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, betas=optim.betas, eps=optim.eps,
                             **adamw_kernel(params, optim.implementation, loss_scaling))


def adamw_kernel(params: list[torch.Tensor], implementation: str, loss_scaling: bool = False) -> dict[str, bool]:
    """`{"fused": True}` where the installed torch has a fused AdamW for these parameters' device and type
    (CUDA and ROCm, CPU since torch 2.4, DTensor shards included), else `{"foreach": True}`.

    float16's loss scaling (`loss_scaling`) takes foreach: FSDP's ShardedGradScaler hands fused AdamW an
    overflow flag of shape [1] where its step counters are scalars, and the step fails.

    Raises:
        ConfigError: `implementation` is "fused" and torch has no fused kernel for these parameters, or the
            run scales its loss (float16).
    """
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "fused" and loss_scaling:
        raise ConfigError("optim.implementation = 'fused' does not work with parallel.param_dtype = float16 (its "
                          "sharded loss scaler); use auto or foreach, or bfloat16")
    fused, _ = _default_to_fused_or_foreach(params, differentiable=False, use_fused=True)
    if implementation == "fused" and not fused:
        devices = sorted({p.device.type for p in params})
        raise ConfigError(f"optim.implementation = 'fused': torch {torch.__version__} has no fused AdamW for "
                          f"parameters on {devices}; use auto or foreach")
    return {"fused": True} if fused and not loss_scaling else {"foreach": True}


def lr_at(step: int, total_steps: int, optim: OptimConfig) -> float:
    """The learning rate for optimizer step `step` (0-based): linear warmup, then cosine/linear/constant decay."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    floor = optim.lr * optim.min_lr_ratio
    if optim.schedule == "linear":
        return optim.lr - (optim.lr - floor) * progress
    return floor + 0.5 * (optim.lr - floor) * (1 + math.cos(math.pi * progress))
