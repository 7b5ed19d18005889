"""The one entry to parallelism: on the meta model, PP stage -> TP -> activation checkpointing -> compile ->
FSDP, then materialize; DDP last; the result is the runner of this rank's model parts (parallel/runner.py).
Whether FSDP or DDP wraps the parts is the checked layout's choice (`mesh.layout.wrapper`), made once."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.mesh import Mesh
from clustertrain.parallel.ac import apply_activation_checkpointing
from clustertrain.parallel.compile import apply_compile
from clustertrain.parallel.pp import PipelineRunner, stage_indices, tie_weights_across_stages
from clustertrain.parallel.runner import LocalRunner, Runner, TokenLoss
from clustertrain.parallel.stages import build_stage
from clustertrain.parallel.tp import apply_tp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize(
    model: nn.Module,
    parallel: ParallelConfig,
    mesh: Mesh,
    device: torch.device,
    blocks: tuple[type[nn.Module], ...],
    materialize: Callable[[nn.Module], None],
    loss: TokenLoss,
    microbatches: int,
) -> Runner:
    """Apply the layout to a meta-device `model`, materialize its weights, and return the runner of its parts.

    FSDP shards on the meta device first, so `materialize` only ever fills local shards; DDP needs full
    weights, so it wraps after `materialize`. With more than one pipeline stage the model is first cut into
    this rank's stages (`blocks` must come from the whole model), each laid out as a whole model would be.
    Each step runs `microbatches` microbatches of a rank's rows through the parts, with `loss`. The degrees
    come from `mesh` alone; `parallel` gives the rest (schedule, checkpointing, compile, dtypes).
    """
    dtype = autocast_dtype(parallel, mesh)
    if mesh.degree("pp") > 1:
        indices, num_stages = stage_indices(parallel, mesh)
        stages = [_parallelize(build_stage(model, s, num_stages), parallel, mesh, device, blocks, materialize)
                  for s in indices]
        tie_weights_across_stages(stages, mesh)
        return PipelineRunner(stages, parallel, mesh, device, microbatches, loss, dtype)
    return LocalRunner(_parallelize(model, parallel, mesh, device, blocks, materialize), loss, microbatches, device,
                       dtype)


def _parallelize(model, parallel, mesh, device, blocks, materialize) -> nn.Module:
    if mesh.degree("tp") > 1:
        apply_tp(model, mesh.tp_mesh(), mesh.layout.sequence_parallel)
    apply_activation_checkpointing(model, parallel.activation_checkpoint, parallel.activation_checkpoint_every, blocks)
    if parallel.compile:
        apply_compile(model, blocks)
    wrapper = mesh.layout.wrapper
    if wrapper == "fsdp":
        apply_fsdp(model, parallel, mesh, blocks)
    materialize(model)
    if wrapper == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def apply_fsdp(model: nn.Module, parallel: ParallelConfig, mesh: Mesh, blocks: tuple[type[nn.Module], ...]) -> None:
    """FSDP2 over each transformer block, then the root. zero2 keeps parameters gathered from forward to backward."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[parallel.param_dtype], reduce_dtype=DTYPES[parallel.reduce_dtype])
    reshard = parallel.strategy.endswith("zero3")
    shard_mesh = mesh.shard_mesh()
    for module in [m for m in model.modules() if isinstance(m, blocks)] + [model]:
        fully_shard(module, mesh=shard_mesh, reshard_after_forward=reshard, mp_policy=policy)
        if shard_mesh.device_type == "cpu":
            # gloo in torch 2.7 and 2.8 takes ReduceOp.AVG as SUM (gradients x dp size): sum, then divide
            module.set_force_sum_reduction_for_comms(True)


def autocast_dtype(parallel: ParallelConfig, mesh: Mesh) -> torch.dtype | None:
    """The autocast dtype when no FSDP mixed-precision policy casts (DDP or no wrapper), else None."""
    if mesh.layout.wrapper != "fsdp" and parallel.param_dtype != "float32":
        return DTYPES[parallel.param_dtype]
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside a DDP wrapper (FSDP2 modifies the model in place and needs no unwrapping)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
