"""Parallel degrees -> named DeviceMesh. The only place that computes which rank is in which group.

The world is laid out as (pp, dp_replicate, dp_shard, tp), tp innermost, so tensor-parallel peers are
neighbouring ranks (the same node, when tp fits in one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from clustertrain.config.checks import resolve_degrees
from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.env import RankInfo

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Mesh:
    """The degrees of this run and this rank's place in them."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    device_mesh: DeviceMesh  # DIMS
    dp_mesh: DeviceMesh  # the data-parallel ranks as one dimension

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: ranks that differ only in tp or pp share data."""
        return self.dp_mesh.get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The process group of this rank's data-parallel peers."""
        return self.dp_mesh.get_group()

    @property
    def pp_rank(self) -> int:
        """This rank's place in the pipeline: it holds stage pp_rank (and pp_rank + pp, ... when interleaved)."""
        return self.device_mesh.get_local_rank("pp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The process group of the ranks that hold the other stages of this rank's pipeline."""
        return self.device_mesh.get_group("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def shard_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: dp_shard, or (dp_replicate, dp_shard) when both are used (hybrid)."""
        if self.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    def tp_mesh(self) -> DeviceMesh:
        return self.device_mesh["tp"]


def degrees(parallel: ParallelConfig, info: RankInfo) -> tuple[int, int, int, int]:
    """(pp, dp_replicate, dp_shard, tp) of this run: clustertrain.config.checks works them out (and the trainer
    has checked them, with the rest of the config, before the process group started)."""
    return resolve_degrees(parallel, info.world_size, info.local_world_size)


def build_mesh(parallel: ParallelConfig, info: RankInfo, device_type: str) -> Mesh:
    """Build the named mesh of this run (collective: every rank calls it).

    Each group of ranks gets one process group (on GPUs, one NCCL communicator, with its memory): the
    data-parallel group is the dp_shard or dp_replicate group when the other is 1, and a group of its own
    only when both are used.
    """
    pp, replicate, shard, tp = degrees(parallel, info)
    device_mesh = init_device_mesh(device_type, (pp, replicate, shard, tp), mesh_dim_names=DIMS)
    if replicate > 1 and shard > 1:
        dp_mesh = device_mesh["dp_replicate", "dp_shard"]._flatten("dp")  # torchtitan's way; no public API yet
    else:
        dp_mesh = device_mesh["dp_replicate" if replicate > 1 else "dp_shard"]
    return Mesh(pp, replicate, shard, tp, device_mesh, dp_mesh)
