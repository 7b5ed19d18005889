"""`parallel.compile`: torch.compile each transformer block in place.

In place (`block.compile()`), so parameter names, FSDP units and checkpoints are those of the plain model.
Dynamo skips `nn.Module._call_impl` and starts tracing at the block's forward: module hooks (FSDP2's
all-gathers and reshards) stay eager, outside the graph, and the graph holds the block's whole forward,
with activation checkpointing its checkpoint too (see `clustertrain.parallel.ac.Checkpointed`).

Every block of a class runs the same compiled code (parameters are graph inputs, not constants), so the
compile time does not grow with depth. Expected recompiles: once for the first block under LoRA (its input
needs no gradient, the others' do), once for evaluation (no gradient) and a few for the end-of-run sample
(a KV cache, growing lengths). tests/unit/parallel/test_compile.py counts graph breaks in Llama and Qwen2
blocks, plain, checkpointed and with LoRA, forward and backward.
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module, blocks: tuple[type[nn.Module], ...], backend: str = "inductor") -> int:
    """Compile every block of `model` whose class is in `blocks`, in place; returns how many.

    Call after activation checkpointing and before FSDP, as torchtitan does. `backend` is torch.compile's
    (tests trace with "eager" or a counting backend).
    """
    found = [m for m in model.modules() if isinstance(m, blocks)]
    for block in found:
        block.compile(backend=backend)
    return len(found)
