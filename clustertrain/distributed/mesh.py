"""Parallel degrees -> named DeviceMesh. The only place that computes which rank is in which group.

The world is laid out as (pp, dp_replicate, dp_shard, tp), tp innermost, so tensor-parallel peers are
neighbouring ranks (the same node, when tp fits in one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.env import RankInfo
from clustertrain.errors import ConfigError

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Mesh:
    """The degrees of this run and this rank's place in them."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    device_mesh: DeviceMesh  # DIMS
    flat_mesh: DeviceMesh  # (pp, dp, tp): the data-parallel ranks as one dimension

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: ranks that differ only in tp or pp share data."""
        return self.flat_mesh.get_local_rank("dp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The process group of this rank's data-parallel peers."""
        return self.flat_mesh.get_group("dp")

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
    """(pp, dp_replicate, dp_shard, tp): set degrees as given; the data-parallel ones default from the strategy."""
    world, model_parallel = info.world_size, parallel.pp * parallel.tp
    if world % model_parallel:
        raise ConfigError(f"parallel.pp × parallel.tp = {parallel.pp} × {parallel.tp} does not divide the {world} "
                          f"ranks; use pp × tp in {_divisors(world)}")
    dp = world // model_parallel
    replicate, shard = parallel.dp_replicate, parallel.dp_shard
    if replicate is None and shard is None:
        replicate, shard = _strategy_split(parallel, info, dp)
    elif replicate is None:
        replicate = dp // shard if dp % shard == 0 else 0
    elif shard is None:
        shard = dp // replicate if dp % replicate == 0 else 0
    if replicate * shard != dp:
        raise ConfigError(
            f"parallel: pp {parallel.pp} × dp_replicate {parallel.dp_replicate or '?'} × dp_shard "
            f"{parallel.dp_shard or '?'} × tp {parallel.tp} must equal the {world} ranks; with pp {parallel.pp} and "
            f"tp {parallel.tp}, dp_replicate × dp_shard must be {dp} (each one of {_divisors(dp)})"
        )
    if parallel.strategy == "ddp" and shard > 1:
        raise ConfigError(f"parallel.dp_shard = {shard} shards, but parallel.strategy is ddp; "
                          "use zero2, zero3 or a hybrid strategy, or dp_shard 1")
    return parallel.pp, replicate, shard, parallel.tp


def _strategy_split(parallel: ParallelConfig, info: RankInfo, dp: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for the strategy: DDP replicates, zero shards, hybrid does both."""
    if parallel.strategy == "ddp":
        return dp, 1
    if not parallel.strategy.startswith("hybrid"):
        return 1, dp
    shard = parallel.hybrid_shard_size or max(1, info.local_world_size // (parallel.pp * parallel.tp))
    if dp % shard:
        raise ConfigError(
            f"parallel.hybrid_shard_size = {shard} does not divide the {dp} data-parallel ranks; use one of "
            f"{_divisors(dp)}"
        )
    return dp // shard, shard


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_mesh(parallel: ParallelConfig, info: RankInfo, device_type: str) -> Mesh:
    """Build the named mesh of this run (collective: every rank calls it)."""
    pp, replicate, shard, tp = degrees(parallel, info)
    device_mesh = init_device_mesh(device_type, (pp, replicate, shard, tp), mesh_dim_names=DIMS)
    flat_mesh = init_device_mesh(device_type, (pp, replicate * shard, tp), mesh_dim_names=("pp", "dp", "tp"))
    return Mesh(pp, replicate, shard, tp, device_mesh, flat_mesh)
