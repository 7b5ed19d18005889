"""Materialize a meta-device model: allocate on the device and initialize, the same for every layout.

Each module is initialized by the model's own HF `_init_weights`, seeded by the module's name, on
full-size temporaries; a sharded (DTensor) parameter then keeps only its local slice. The initial
weights are therefore identical under 1 rank, DDP and any FSDP layout, and no rank ever holds more than
one module's full parameters at once. A snapshot's weights (safetensors or .bin) then overwrite them,
each rank reading only the slices it owns.
"""

from __future__ import annotations

import functools
import json
import pickle
import re
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedModel

from clustertrain.errors import CheckpointError, ConfigError, first_line

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@torch.no_grad()
def init_weights(model: PreTrainedModel, device: torch.device, seed: int) -> None:
    """Allocate `model` on `device` and initialize it from `seed`, independent of how it is sharded."""
    model.to_empty(device=device)
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and all(id(p) in seen for p in own):
            continue  # a tied head keeps the values of the embedding it shares, sharded or not
        seen.update(id(p) for p in own)
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
    if hasattr(module, "rope_init_fn") and "original_inv_freq" not in module._buffers:  # transformers 4.x's rotary
        _init_rotary(module, device)
    for n, p in sharded.items():
        full = module._parameters[n].data
        p.to_local().copy_(full[_local_index(p)])
        module._parameters[n] = p


def _init_rotary(module: nn.Module, device: torch.device) -> None:
    """Compute a transformers 4.x rotary embedding's `inv_freq` again: its __init__ alone fills that buffer, so
    `to_empty` leaves it uninitialized (5.x's `_init_weights` computes it, and keeps `original_inv_freq` a buffer)."""
    inv_freq, module.attention_scaling = module.rope_init_fn(module.config, device)
    module.inv_freq.copy_(inv_freq)
    module.original_inv_freq = module.inv_freq  # as __init__ leaves it: the value dynamic rope scaling returns to


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
    from clustertrain.lora import hf_name, is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    prefix = hf_model.base_model_prefix
    keys = {key: path for path in weight_files(snapshot) for key in tensor_names(path)}
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
        index = _local_index(tensor)
        local.copy_(read_tensor(keys[key], key, index))
    if getattr(hf_model.config, "tie_word_embeddings", False):  # the head is the embedding, tied below
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise ConfigError(f"{snapshot}: no weights for {len(missing)} parameters of this architecture, e.g. "
                          f"{', '.join(missing[:3])}; is model.path the model its config.json describes?")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _local_index(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the full tensor that this rank's shard of `tensor` holds (no communication)."""
    return tuple(slice(o, o + n) for n, o in zip(*_local_box(tensor)))


def _local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's piece of `tensor`."""
    if isinstance(tensor, DTensor):
        return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(tensor.shape), (0,) * tensor.ndim


def weight_files(snapshot: Path) -> list[Path]:
    """The snapshot's weight files: its safetensors (or .bin) shards by their index, or the single file."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = snapshot / index_name
        if index.is_file():
            return sorted({snapshot / f for f in json.loads(index.read_text())["weight_map"].values()})
        if (snapshot / single).is_file():
            return [snapshot / single]
    raise ConfigError(f"{snapshot}: no model.safetensors or pytorch_model.bin (nor their sharded index)")


def tensor_names(path: Path) -> list[str]:
    """The names of the tensors in one weight file, read from its header (a .bin is loaded weights-only)."""
    if path.suffix == ".safetensors":
        try:
            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:  # truncated or not safetensors at all
            raise CheckpointError(f"{path} is not a readable safetensors file ({str(e).strip()[:200]})") from None
    return list(_bin(path))


def read_tensor(path: Path, key: str, index: tuple[slice, ...]) -> torch.Tensor:
    """The `index` slice of tensor `key` of one weight file (safetensors reads only that slice)."""
    # Opened per tensor on purpose: an open file keeps every page read so far mapped into the rank,
    # so holding it for the whole load would cost a second copy of the model in memory.
    if path.suffix == ".safetensors":
        with safe_open(path, framework="pt") as f:
            piece = f.get_slice(key)
            return piece[index] if index else f.get_tensor(key)
    return _bin(path)[key][index]


def refusal(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, in a few words, without its advice to load unsafely."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    if found:
        return f"it refers to {found.group(1)}"
    _, _, detail = str(error).partition("WeightsUnpickler error:")
    return next((line.strip()[:200] for line in detail.splitlines() if line.strip()), type(error).__name__)


def read_pth(file: Path) -> dict[str, torch.Tensor]:
    """A `.bin`/`.pth`/`.pt` state dict, memory-mapped (no copy in RAM) and weights-only: one line if it holds code
    or anything but tensors."""
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file} holds code or non-tensor objects ({refusal(e)}) and was not loaded") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{file} is not a readable PyTorch weights file ({first_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} holds no state dict of tensors and was not loaded")
    return state


_bin = functools.lru_cache(maxsize=2)(read_pth)  # a snapshot's .bin shards, read once for all their tensors
