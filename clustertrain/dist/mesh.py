"""Parallel degrees -> named DeviceMesh. The only place that computes which rank is in which group."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from clustertrain.config.schema import ParallelConfig
from clustertrain.dist.env import RankInfo
from clustertrain.errors import ConfigError


@dataclass
class Mesh:
    """Data-parallel degrees of this run and this rank's place in them."""

    dp_replicate: int
    dp_shard: int
    device_mesh: DeviceMesh | None

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def shard_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (dp_shard) or 2-D (dp_replicate, dp_shard) for hybrid sharding."""
        assert self.device_mesh is not None
        return self.device_mesh if self.dp_replicate > 1 else self.device_mesh["dp_shard"]


def data_parallel_degrees(parallel: ParallelConfig, info: RankInfo) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for the strategy: DDP replicates, zero shards, hybrid does both."""
    world = info.world_size
    if parallel.strategy == "ddp":
        return world, 1
    if not parallel.strategy.startswith("hybrid"):
        return 1, world
    shard = parallel.hybrid_shard_size or info.local_world_size
    if world % shard:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"parallel.hybrid_shard_size = {shard} does not divide the {world} ranks; use one of {fits}"
        )
    return world // shard, shard


def build_mesh(parallel: ParallelConfig, info: RankInfo, device_type: str) -> Mesh:
    """Build the named mesh of this run."""
    replicate, shard = data_parallel_degrees(parallel, info)
    device_mesh = None
    if parallel.strategy != "ddp":
        device_mesh = init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return Mesh(replicate, shard, device_mesh)
