"""Activation checkpointing: a block's activations are recomputed in backward instead of kept from forward."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int, blocks: tuple[type[nn.Module], ...]) -> None:
    """Checkpoint every block (`full`), every `every`-th block from the first (`selective`), or none.

    The block's own forward is replaced, not the block wrapped, so parameter names, sharding units and
    checkpoints are the same with and without it. Non-reentrant checkpointing also works when the block's
    inputs need no gradient, as under LoRA, where the embeddings are frozen.
    """
    if mode == "none":
        return
    stride = 1 if mode == "full" else every
    for block in [m for m in model.modules() if isinstance(m, blocks)][::stride]:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
