"""Fused kernels (`model.kernels`): liger-kernel's RMSNorm, RoPE, SwiGLU and fused linear cross entropy on CUDA,
else PyTorch's own.

liger-kernel is optional (`pip install liger-kernel`, CUDA and ROCm builds): it is imported only where it
can run, and every other case falls back to PyTorch with one line saying why:

    kernels = apply_kernels(meta_model, model.kernels, device, parallel.tp)
    if kernels.note: logger.info(kernels.note)   # e.g. "model.kernels: liger needs CUDA; using PyTorch kernels"
    apply_loss_head(meta_model, ..., fused=kernels.linear_cross_entropy)   # clustertrain.train.loss

The norm, rotary and MLP kernels are patched into the meta model's modules (liger's instance patching), so
they travel with it into pipeline stages, under LoRA (peft's adapters sit on the projections the MLP calls)
and through sharding. Liger's loss is used in place of the chunked loss, inside the model's head.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from clustertrain.data.pack import IGNORE_INDEX


@dataclass
class Kernels:
    """What `apply_kernels` did.

    Attributes:
        name: "liger" or "none" (PyTorch's kernels).
        linear_cross_entropy: Liger's fused output layer + loss, `(hidden [N, H], weight [V, H], bias, labels
            [N]) -> summed loss`, or None.
        note: one line for the log when `model.kernels` could not be honoured, else None.
    """

    name: str
    linear_cross_entropy: Callable | None = None
    note: str | None = None


def apply_kernels(model: nn.Module, kernels: str, device: torch.device, tp: int = 1) -> Kernels:
    """Patch liger-kernel's fused kernels into `model` (meta or not; peft-wrapped or not) where they can run.

    `kernels` is `model.kernels`: "none" keeps PyTorch's; "liger" and "auto" use Liger when it can run here,
    and otherwise fall back, "liger" with a line saying why and "auto" with one only on CUDA (on a CPU nothing
    else was to be expected).
    """
    if kernels == "none":
        return Kernels("none")
    from clustertrain.lora import is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    reason = liger_unavailable(hf_model.config.model_type, device, tp)
    if reason:
        quiet = kernels == "auto" and device.type != "cuda"
        return Kernels("none", note=None if quiet else f"model.kernels: {kernels}: {reason}; using PyTorch kernels")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    # The loss is clustertrain's (in the head), so liger's own forward replacements stay off.
    _apply_liger_kernel_to_instance(model=hf_model, rope=True, rms_norm=True, swiglu=True, geglu=True,
                                    cross_entropy=False, fused_linear_cross_entropy=False)
    return Kernels("liger", linear_cross_entropy=liger_linear_cross_entropy)


def liger_unavailable(model_type: str, device: torch.device, tp: int = 1) -> str | None:
    """Why Liger cannot run here (one phrase), or None when it can."""
    if device.type != "cuda":
        return "liger needs CUDA"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if tp > 1:
        return "liger is not combined with parallel.tp > 1 (its kernels take whole tensors)"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:  # a liger-kernel without the patching API, or one that fails to import
        return f"liger-kernel does not import ({e})"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger has no kernels for {model_type}"
    return None


def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross entropy of `hidden @ weight.T + bias` by Liger's fused kernel (CUDA)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, ignore_index=IGNORE_INDEX, reduction="sum")
    out = getattr(out, "loss", out)  # versions return the loss, a tuple, or an output object
    return out[0] if isinstance(out, tuple) else out
