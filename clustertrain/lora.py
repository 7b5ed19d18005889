"""LoRA through peft: wrap the meta model before sharding, start the adapters as the identity, merge on export."""

from __future__ import annotations

import re

import peft
import torch
from torch import nn
from transformers import PreTrainedModel

from clustertrain.config.schema import LoraConfig
from clustertrain.errors import ConfigError, one_line

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor

_WRAPPING = re.compile(r"^base_model\.model\.|\.base_layer(?=\.)")


def apply_lora(model: PreTrainedModel, lora: LoraConfig, base_dtype: torch.dtype = torch.float32) -> peft.PeftModel:
    """Add LoRA adapters to `model` (on any device, meta included) and freeze everything else.

    The frozen base is stored in `base_dtype` (the compute dtype): it needs no fp32 master copy, as it never
    changes. The adapters stay fp32, the optimizer's master weights.
    """
    config = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # a target module the model does not have (model.path models: seen only here)
        raise ConfigError(f"lora.target_modules = {lora.target_modules}: {one_line(e)}") from None
    for param in wrapped.parameters():
        if not param.requires_grad:
            param.data = param.data.to(base_dtype)
    return wrapped


def is_lora(model: nn.Module) -> bool:
    """A peft-wrapped model, or a pipeline stage of one (clustertrain.parallel.stages.LoraStage, which stands in
    for the PeftModel with the same `get_base_model()`)."""
    return isinstance(model, peft.PeftModel) or callable(getattr(model, "get_base_model", None))


def hf_name(name: str) -> str:
    """The plain HF parameter name behind a peft-wrapped one (`...q_proj.base_layer.weight` -> `...q_proj.weight`)."""
    return _WRAPPING.sub("", name)


@torch.no_grad()
def start_as_identity(model: nn.Module) -> None:
    """Zero every lora_B, so the adapted model computes exactly what the base model does (LoRA's init)."""
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            (param.to_local() if isinstance(param, DTensor) else param).zero_()
