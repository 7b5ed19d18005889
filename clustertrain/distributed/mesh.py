"""The checked layout -> named DeviceMesh. The only place that computes which rank is in which group.

The world is laid out along clustertrain.config.layout.DIMS, in its order (tp innermost, so tensor-parallel
peers are neighbouring ranks: the same node, when tp fits in one), one named mesh dimension each. The degrees
come from the one Layout that clustertrain.config.layout resolved before the process group started; nothing
here works them out again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from clustertrain.config.layout import DIMS, Layout


@dataclass
class Mesh:
    """The layout of this run (its degrees, its data-parallel wrapper) and this rank's place in it."""

    layout: Layout
    device_mesh: DeviceMesh  # DIMS
    dp_mesh: DeviceMesh  # the data-parallel ranks as one dimension

    def degree(self, dim: str) -> int:
        """The ranks along dimension `dim` (one of clustertrain.config.layout.DIMS)."""
        return self.layout.degree(dim)

    @property
    def dp_size(self) -> int:
        return self.layout.dp

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
        return self.pp_rank == self.degree("pp") - 1

    def shard_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: dp_shard, or (dp_replicate, dp_shard) when both are used (hybrid)."""
        if self.degree("dp_replicate") > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    def tp_mesh(self) -> DeviceMesh:
        return self.device_mesh["tp"]


def build_mesh(layout: Layout, device_type: str) -> Mesh:
    """Build the named mesh of `layout` (collective: every rank calls it, `layout.world_size` of them).

    Each group of ranks gets one process group (on GPUs, one NCCL communicator, with its memory): the
    data-parallel group is the dp_shard or dp_replicate group when the other is 1, and a group of its own
    only when both are used.
    """
    replicate, shard = layout.degree("dp_replicate"), layout.degree("dp_shard")
    device_mesh = init_device_mesh(device_type, tuple(layout.degree(dim) for dim in DIMS), mesh_dim_names=DIMS)
    if replicate > 1 and shard > 1:
        dp_mesh = device_mesh["dp_replicate", "dp_shard"]._flatten("dp")  # torchtitan's way; no public API yet
    else:
        dp_mesh = device_mesh["dp_replicate" if replicate > 1 else "dp_shard"]
    return Mesh(layout, device_mesh, dp_mesh)
