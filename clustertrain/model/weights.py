"""Materialize a meta-device model: allocate on the device and initialize, the same for every layout.

Each module is initialized by the model's own HF `_init_weights`, seeded by the module's name, on
full-size temporaries; a sharded (DTensor) parameter then keeps only its local slice. The initial
weights are therefore identical under 1 rank, DDP and any FSDP layout, and no rank ever holds more than
one module's full parameters at once. A snapshot's weights (safetensors or .bin) then overwrite them,
each rank reading only the slices it owns.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

from clustertrain.errors import ConfigError

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


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


def materialize(model: nn.Module, device: torch.device, seed: int, snapshot: Path | None) -> None:
    """Initialize `model` (seeded, layout-independent), then load the snapshot's weights and zero LoRA's B."""
    init_weights(model, device, seed)
    if snapshot is not None:
        load_pretrained(model, snapshot)
    from clustertrain.lora import is_lora, start_as_identity

    if is_lora(model):
        start_as_identity(model)


@torch.no_grad()
def load_pretrained(model: nn.Module, snapshot: Path) -> None:
    """Copy a HF snapshot's weights into `model`'s parameters and buffers, sharded or not.

    A DTensor parameter reads only its local slice from the file (safetensors reads lazily), so no rank
    ever holds the full model. Tied weights and LoRA adapters are not in the file and keep their values.
    """
    from clustertrain.lora import is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    prefix = hf_model.base_model_prefix
    with contextlib.ExitStack() as files:  # each weight file is opened once
        readers = [_open(path, files) for path in _weight_files(snapshot)]
        keys = {key: reader for reader in readers for key in reader.keys()}
        missing = _copy_weights(model, keys, prefix)
    if getattr(hf_model.config, "tie_word_embeddings", False):  # the head is the embedding, tied below
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise ConfigError(f"{snapshot}: no weights for {len(missing)} parameters of this architecture, e.g. "
                          f"{', '.join(missing[:3])}; is model.path the model its config.json describes?")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _copy_weights(model: nn.Module, keys: dict, prefix: str) -> list[str]:
    """Copy every parameter and buffer found under `keys` (name -> open file); returns the parameters not found."""
    from clustertrain.lora import hf_name

    missing = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        key = hf_name(name)
        if ".lora_" in name:
            continue
        if key not in keys and prefix and key.startswith(prefix + "."):
            key = key[len(prefix) + 1:]  # base-model checkpoints (e.g. GPT-2's) leave out the prefix
        if key not in keys:
            if isinstance(tensor, nn.Parameter):
                missing.append(key)
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        index = tuple(slice(o, o + n) for n, o in zip(*_local_box(tensor)))
        reader = keys[key]
        if isinstance(reader, dict):  # a .bin state dict, memory-mapped
            local.copy_(reader[key][index])
        else:  # safetensors reads only the slice asked for
            local.copy_(reader.get_slice(key)[index] if index else reader.get_tensor(key))
    return missing


def _local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's piece of `tensor`."""
    if isinstance(tensor, DTensor):
        return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(tensor.shape), (0,) * tensor.ndim


def _weight_files(snapshot: Path) -> list[Path]:
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = snapshot / index_name
        if index.is_file():
            return sorted({snapshot / f for f in json.loads(index.read_text())["weight_map"].values()})
        if (snapshot / single).is_file():
            return [snapshot / single]
    raise ConfigError(f"{snapshot}: no model.safetensors or pytorch_model.bin (nor their sharded index)")


def _open(path: Path, files: contextlib.ExitStack):
    """A safetensors file opened lazily, or a .bin state dict memory-mapped and loaded without unpickling code."""
    if path.suffix == ".safetensors":
        return files.enter_context(safe_open(path, framework="pt"))
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
