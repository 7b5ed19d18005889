"""Fused kernels (`model.kernels`): liger-kernel's RMSNorm, RoPE, SwiGLU and fused linear cross entropy on CUDA,
else PyTorch's own.

liger-kernel is optional (`pip install liger-kernel`, CUDA and ROCm builds): it is imported only where it
can run, and every other case falls back to PyTorch with one line saying why:

    kernels = apply_kernels(meta_model, model.kernels, device, parallel.tp)
    if kernels.note: logger.info(kernels.note)   # e.g. "model.kernels: liger: liger needs CUDA; using PyTorch kernels"
    apply_loss_head(meta_model, ..., fused=kernels.linear_cross_entropy)   # clustertrain.model.loss

The norm, rotary and MLP kernels are patched into the meta model's modules (liger's instance patching), so
they travel with it into pipeline stages, under LoRA (peft's adapters sit on the projections the MLP calls)
and through sharding. Liger's loss is used in place of the chunked loss, inside the model's head.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.errors import ConfigError, one_line


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

    `kernels` is `model.kernels`: "none" keeps PyTorch's; "liger" and "auto" use Liger where it applies (see
    `liger_unavailable`). Elsewhere "auto" falls back, with a line saying why on CUDA (on a CPU nothing else
    was to be expected). Where Liger applies but fails (it does not import, or its patching raises), the model
    is left as it was and "auto" falls back with a line saying why. An explicit "liger" on a CPU falls back
    with a line, so that a GPU config also runs on a laptop.

    Raises:
        ConfigError: `kernels` is "liger" on CUDA, and Liger cannot run or fails.
    """
    if kernels == "none":
        return Kernels("none")
    from clustertrain.lora import is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    model_type = hf_model.config.model_type
    try:
        reason = liger_unavailable(model_type, device, tp)
        if reason is None:
            with _undone_on_error(hf_model):
                _patch_liger(hf_model)
    except Exception as e:  # anything liger-kernel raises: a start never breaks on an optional dependency
        failure = f"liger-kernel fails on {model_type} ({_one_line(e)})"
        if kernels == "liger":
            raise ConfigError(f"model.kernels: liger: {failure}; repair or upgrade liger-kernel "
                              "(pip install -U liger-kernel), or set model.kernels to auto or none") from e
        return Kernels("none", note=f"model.kernels: {kernels}: {failure}; using PyTorch kernels")
    if reason and kernels == "liger" and device.type == "cuda":
        raise ConfigError(f"model.kernels: liger: {reason}; install a liger-kernel that runs here, or set "
                          "model.kernels to auto or none")
    if reason:
        quiet = kernels == "auto" and device.type != "cuda"
        return Kernels("none", note=None if quiet else f"model.kernels: {kernels}: {reason}; using PyTorch kernels")
    return Kernels("liger", linear_cross_entropy=liger_linear_cross_entropy)


def liger_unavailable(model_type: str, device: torch.device, tp: int = 1) -> str | None:
    """Why Liger does not apply here (one phrase), or None when it does.

    Raises whatever importing liger-kernel raises (a broken install: `apply_kernels` reports it).
    """
    if device.type != "cuda":
        return "liger needs CUDA"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if tp > 1:
        return "liger is not combined with parallel.tp > 1 (its kernels take whole tensors)"
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if "accum_dtype" not in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        return "this liger-kernel is too old: its fused loss takes no accum_dtype (pip install -U liger-kernel)"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger has no kernels for {model_type}"
    return None


def _patch_liger(hf_model: nn.Module) -> None:
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    # The loss is clustertrain's (in the head), so liger's own forward replacements stay off.
    _apply_liger_kernel_to_instance(model=hf_model, rope=True, rms_norm=True, swiglu=True, geglu=True,
                                    cross_entropy=False, fused_linear_cross_entropy=False)


@contextmanager
def _undone_on_error(model: nn.Module) -> Iterator[None]:
    """Put back what a patch that raises had changed: the modules' attributes (liger binds forwards and
    sets fields per instance) and the globals of the files that define their classes (liger swaps
    functions and classes there, e.g. `modeling_llama.apply_rotary_pos_emb`)."""
    namespaces = [m.__dict__ for m in model.modules()]
    namespaces += [vars(sys.modules[name]) for name in {type(m).__module__ for m in model.modules()}
                   if name in sys.modules]
    saved = [dict(namespace) for namespace in namespaces]
    try:
        yield
    except BaseException:
        for namespace, before in zip(namespaces, saved):
            for key in namespace.keys() - before.keys():
                del namespace[key]
            namespace.update(before)
        raise


def _one_line(error: BaseException) -> str:
    text = one_line(error)
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross entropy of `hidden @ weight.T + bias` by Liger's fused kernel (CUDA).

    The head's gradient is accumulated over Liger's chunks in fp32 (`accum_dtype`), not in the weights' own
    dtype (bf16 under FSDP's mixed precision). Nothing here waits on the GPU; Liger itself does (it counts the
    labels that are not ignored with `.item()` in forward, and compares the incoming gradient with 1 by
    `torch.equal` in backward).
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, ignore_index=IGNORE_INDEX, reduction="sum",
                                           accum_dtype=torch.float32)
    out = getattr(out, "loss", out)  # versions return the loss, a tuple, or an output object
    return out[0] if isinstance(out, tuple) else out
