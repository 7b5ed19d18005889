"""Materialize a meta-device model: allocate on the device and initialize, the same for every layout.

Each module is initialized by the model's own HF `_init_weights`, seeded by the module's name, on
full-size temporaries; a sharded (DTensor) parameter then keeps only its local slice. The initial
weights are therefore identical under 1 rank, DDP and any FSDP layout, and no rank ever holds more than
one module's full parameters at once.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from transformers import PreTrainedModel

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor, distribute_tensor


@torch.no_grad()
def init_weights(model: PreTrainedModel, device: torch.device, seed: int) -> None:
    """Allocate `model` on `device` and initialize it from `seed`, independent of how it is sharded."""
    model.to_empty(device=device)
    for name, module in model.named_modules():
        _init_module(model, module, device, seed + zlib.crc32(name.encode()))
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _init_module(model: PreTrainedModel, module: nn.Module, device: torch.device, seed: int) -> None:
    sharded = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for n, p in sharded.items():
        module._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model._init_weights(module)
    for n, p in sharded.items():
        full = module._parameters[n].data
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
        module._parameters[n] = p
