"""Activation checkpointing: a block's activations are recomputed in backward instead of kept from forward."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default}
# The expensive ops whose outputs `selective` keeps: matmuls (every other one), attention on every backend,
# and tensor parallelism's collectives (dearer to rerun than to keep).
KEPT = MATMULS | {
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten._scaled_dot_product_attention_math.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int,
                                   blocks: tuple[type[nn.Module], ...]) -> None:
    """Checkpoint every block (`full`), every block op by op (`selective`), every `every`-th block from the first
    (`every_n`), or none.

    The block's own forward is replaced, not the block wrapped, so parameter names, sharding units and
    checkpoints are the same with and without it. Non-reentrant checkpointing also works when the block's
    inputs need no gradient, as under LoRA, where the embeddings are frozen.
    """
    if mode == "none":
        return
    stride = every if mode == "every_n" else 1
    for block in [m for m in model.modules() if isinstance(m, blocks)][::stride]:
        block.forward = Checkpointed(block.forward, selective=mode == "selective")


def selective_contexts():
    """The forward and recompute contexts of one op-level checkpointed call: the outputs of the ops in `KEPT`
    are saved, except every second matmul, and the rest (norms, activations, elementwise) recomputed. As
    torchtitan's `op` mode: about half the matmul FLOPs are not rerun, at the memory of half their outputs."""
    matmuls = {"forward": 0, "recompute": 0}  # counted apart, so the recompute pairs the same matmuls

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            phase = "recompute" if ctx.is_recompute else "forward"
            matmuls[phase] += 1
            if matmuls[phase] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in KEPT else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Checkpointed:
    """`forward` under non-reentrant checkpointing, whole or op by op (`selective`).

    Not `functools.partial(checkpoint, forward)`: a compiled block (dynamo skips its `_call_impl`) starts
    tracing at its forward, and a partial hands dynamo straight to `checkpoint`, which dynamo never enters
    on its own, so the whole block silently ran uncompiled. Traced from `__call__`, the checkpoint becomes
    dynamo's activation-checkpoint operator inside the block's graph. An object rather than a closure, so a
    deep copy of the model calls the copied block.
    """

    def __init__(self, forward: Callable, selective: bool = False):
        self.forward = forward
        self.selective = selective

    def __call__(self, *args, **kwargs):
        if self.selective:
            return checkpoint(self.forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
