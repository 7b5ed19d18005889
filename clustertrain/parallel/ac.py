"""Activation checkpointing: a block's activations are recomputed in backward instead of kept from forward."""

from __future__ import annotations

from collections.abc import Callable

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
        block.forward = Checkpointed(block.forward)


class Checkpointed:
    """`forward` under non-reentrant checkpointing.

    Not `functools.partial(checkpoint, forward)`: a compiled block (dynamo skips its `_call_impl`) starts
    tracing at its forward, and a partial hands dynamo straight to `checkpoint`, which dynamo never enters
    on its own, so the whole block silently ran uncompiled. Traced from `__call__`, the checkpoint becomes
    dynamo's activation-checkpoint operator inside the block's graph. An object rather than a closure, so a
    deep copy of the model calls the copied block.
    """

    def __init__(self, forward: Callable):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
