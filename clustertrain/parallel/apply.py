"""The one entry to parallelism: wrap the meta model for the strategy, materialize it, wrap for DDP."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from clustertrain.config.schema import ParallelConfig
from clustertrain.dist.mesh import Mesh
from clustertrain.parallel.ac import apply_activation_checkpointing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize(
    model: nn.Module,
    parallel: ParallelConfig,
    mesh: Mesh,
    device: torch.device,
    blocks: tuple[type[nn.Module], ...],
    materialize: Callable[[nn.Module], None],
) -> nn.Module:
    """Apply activation checkpointing and the data-parallel strategy to a meta-device `model`, and materialize it.

    FSDP shards on the meta device first, so `materialize` only ever fills local shards; DDP needs full
    weights, so it wraps after `materialize`.
    """
    apply_activation_checkpointing(model, parallel.activation_checkpoint, parallel.activation_checkpoint_every, blocks)
    if parallel.strategy == "ddp":
        materialize(model)
        if mesh.dp_size == 1:
            return model
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    apply_fsdp(model, parallel, mesh, blocks)
    materialize(model)
    return model


def apply_fsdp(model: nn.Module, parallel: ParallelConfig, mesh: Mesh, blocks: tuple[type[nn.Module], ...]) -> None:
    """FSDP2 over each transformer block, then the root. zero2 keeps parameters gathered from forward to backward."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[parallel.param_dtype], reduce_dtype=DTYPES[parallel.reduce_dtype])
    reshard = parallel.strategy.endswith("zero3")
    for module in model.modules():
        if isinstance(module, blocks):
            fully_shard(module, mesh=mesh.shard_mesh(), reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh.shard_mesh(), reshard_after_forward=reshard, mp_policy=policy)


def autocast_dtype(parallel: ParallelConfig) -> torch.dtype | None:
    """The autocast dtype for strategies without a mixed-precision policy of their own (DDP), else None."""
    if parallel.strategy == "ddp" and parallel.param_dtype != "float32":
        return DTYPES[parallel.param_dtype]
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside a DDP wrapper (FSDP2 modifies the model in place and needs no unwrapping)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
