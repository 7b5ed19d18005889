"""Write a checkpoint's weights as Hugging Face safetensors, one shard at a time, in the dtype asked for.

The model is only ever built on the meta device: it gives the names, shapes, dtypes and ties, so each shard's
safetensors header is written first. Its tensors then follow one at a time: read (from the DCP checkpoint, which
casts into a buffer of the asked dtype, or, for a LoRA run's frozen base, from its snapshot), merged with their
adapter where asked, cast and written. The most memory alive is one tensor (and DCP's fp32 copy of it while it
reads), never a shard or the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from clustertrain.checkpoint.reader import check_fits, load_state
from clustertrain.errors import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


@dataclass
class Entry:
    """One output tensor: where it comes from and, for a merged LoRA weight, the layer whose update it takes."""

    name: str  # its name in the Hugging Face files
    source: str  # its name in the (peft-wrapped) model, the checkpoint's key without "model."
    shape: tuple[int, ...]
    dtype: torch.dtype  # the model's: floating-point tensors are written in the export's dtype, others as they are
    in_checkpoint: bool  # else read from the snapshot
    lora: LoraLayer | None = None


class Snapshot:
    """Tensors of a Hugging Face snapshot, read one at a time (safetensors reads lazily, .bin is memory-mapped)."""

    def __init__(self, path: Path, prefix: str):
        from clustertrain.model.weights import tensor_names, weight_files

        self.path, self.prefix = path, prefix
        self.files = {key: file for file in weight_files(path) for key in tensor_names(file)}

    def read(self, name: str) -> torch.Tensor:
        from clustertrain.model.weights import read_tensor

        key = name
        if key not in self.files and self.prefix and key.startswith(self.prefix + "."):
            key = key[len(self.prefix) + 1:]  # base-model checkpoints (e.g. GPT-2's) leave out the prefix
        if key not in self.files:
            raise CheckpointError(f"{self.path}: no weight {name}; is it the base model the adapters were trained on?")
        return read_tensor(self.files[key], key, ())


def plan_entries(model: nn.Module, metadata: Metadata, merge: bool) -> list[Entry]:
    """The tensors of the full model's HF files, in state-dict order, each tied weight once.

    `model` is the checkpoint's model on the meta device. A parameter is read from the checkpoint when it holds
    it (every parameter of a full run; the trainable ones of a LoRA run), else from the frozen base's snapshot.
    With `merge`, a LoRA layer's base weight takes its adapter's update.
    """
    from clustertrain.lora import hf_name

    saved = metadata.state_dict_metadata
    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    entries, seen = [], set()
    for source, tensor in model.state_dict(keep_vars=True).items():
        if ".lora_" in source or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        owner, _, leaf = source.rpartition(".base_layer.")
        lora = layers.get(owner) if merge and leaf == "weight" else None
        entries.append(Entry(hf_name(source), source, tuple(tensor.shape), tensor.dtype, f"model.{source}" in saved,
                             lora))
    return entries


def check_checkpoint_fits(path: Path, metadata: Metadata, model: nn.Module, base_elsewhere: bool) -> None:
    """check_fits for an export: every tensor the checkpoint must hold, of the right shape; with `base_elsewhere`
    (a LoRA checkpoint that refers to its base) the frozen parameters may be absent."""
    saved = metadata.state_dict_metadata
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    expected = {k: v for k, v in model.state_dict().items()
                if not base_elsewhere or k in trainable or f"model.{k}" in saved}
    check_fits(path, metadata, {"model": expected})


def load_adapters(model: nn.Module, path: Path, metadata: Metadata) -> dict[str, torch.Tensor]:
    """Allocate the LoRA layers' adapter weights of meta `model` on the CPU and load them from the checkpoint."""
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapters in (module.lora_A, module.lora_B):
                adapters.to_empty(device="cpu")
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    load_state({"model": adapters}, path, metadata)
    return adapters


def write_adapter(model: nn.Module, adapters: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype,
                  base_path: str) -> None:
    """peft's adapter files: `adapter_model.safetensors` (in `dtype`) and `adapter_config.json` naming `base_path`."""
    state = get_peft_model_state_dict(model, state_dict=adapters)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, folder / "adapter_model.safetensors",
              metadata={"format": "pt"})
    config = model.peft_config["default"]
    config.base_model_name_or_path = base_path
    config.inference_mode = True
    config.save_pretrained(folder)


def write_weights(entries: list[Entry], folder: Path, dtype: torch.dtype, max_shard_size: int, path: Path,
                  metadata: Metadata, snapshot: Snapshot | None, base_dtype: torch.dtype) -> list[str]:
    """Write `entries` as safetensors shards of at most `max_shard_size` bytes (and their index when more than one),
    one tensor in memory at a time; returns the file names.

    Floating-point tensors are written in `dtype`, others as they are. A tensor read from the snapshot is first
    rounded to `base_dtype`, as training stored the frozen base.
    """
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _numel(entry.shape) * _out_dtype(entry, dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for shard, name in zip(shards, names):
        header = {"__metadata__": {"format": "pt"}}
        offset = 0
        for entry in shard:
            nbytes = _numel(entry.shape) * _out_dtype(entry, dtype).itemsize
            header[entry.name] = {"dtype": SAFETENSORS_DTYPES[_out_dtype(entry, dtype)], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(folder / name, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little") + encoded)
            for entry in shard:
                tensor = _read_entry(entry, _out_dtype(entry, dtype), path, metadata, snapshot, base_dtype)
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        weight_map.update({entry.name: name for entry in shard})
        total += offset
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def _out_dtype(entry: Entry, dtype: torch.dtype) -> torch.dtype:
    return dtype if entry.dtype.is_floating_point else entry.dtype


def _read_entry(entry: Entry, dtype: torch.dtype, path: Path, metadata: Metadata, snapshot: Snapshot | None,
                base_dtype: torch.dtype) -> torch.Tensor:
    """One output tensor in `dtype`: from the checkpoint (DCP casts as it copies into the buffer) or the snapshot,
    with its LoRA update added in fp32 where it takes one."""
    if entry.in_checkpoint:
        tensor = torch.empty(entry.shape, dtype=torch.float32 if entry.lora else dtype)
        load_state({"model": {entry.source: tensor}}, path, metadata)
    elif snapshot is None:
        raise CheckpointError(f"{path} has no {entry.source} and names no base model to read it from")
    else:
        tensor = snapshot.read(entry.name).to(base_dtype if entry.dtype.is_floating_point else entry.dtype)
    if entry.lora is not None:
        with torch.no_grad():
            tensor = tensor.float() + entry.lora.get_delta_weight("default").float()
    return tensor.to(dtype).contiguous()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
