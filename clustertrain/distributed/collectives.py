"""The collectives clustertrain itself calls, on tensors built on the device of the group's backend.

An NCCL group (RCCL on ROCm) has no CPU backend: a scalar made with `torch.tensor(...)` lands on the CPU
and fails there with "No backend type associated with device type cpu"; a gloo group takes CPU tensors.
So every count, loss, norm, memory figure and stop flag that ranks agree on goes through this module,
which builds its tensors on `group_device(group)`; no other module calls a torch.distributed collective
on a tensor it built itself (tests/unit/distributed/test_collectives.py reads the package's source to keep it so).

    set_rank_device(device)                               # once, when the process group starts
    tokens = all_reduce(local_tokens, group=mesh.dp_group)  # a tensor on the group's device
    peak_gb, = reduce_values([memory_gb], op="max")        # Python numbers in, Python floats out
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_rank_device = torch.device("cpu")


def set_rank_device(device: torch.device) -> None:
    """Record this rank's one device (chosen once, by clustertrain.distributed.init)."""
    global _rank_device
    _rank_device = device


def rank_device() -> torch.device:
    """This rank's device: cuda:<local rank> on GPU nodes, else cpu."""
    return _rank_device


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors `group` takes: this rank's GPU for an NCCL group, the CPU for a gloo group.

    Gloo also accepts GPU tensors, but copies them to the host, which waits for the GPU: a gloo side group
    (stop agreement, async saves) exists precisely to keep the training stream free of such syncs.
    """
    backends = dict(part.split(":") for part in dist.get_backend_config(group).split(","))
    if backends.get(_rank_device.type, "gloo") != "gloo":
        return _rank_device
    if "cpu" in backends:
        return torch.device("cpu")
    if _rank_device.type in backends:
        return _rank_device
    raise RuntimeError(f"process group with backends {backends} serves neither {_rank_device} nor the CPU")


def all_reduce(values: torch.Tensor | Sequence[float], group: dist.ProcessGroup | None = None,
               op: str = "sum") -> torch.Tensor:
    """`values` reduced over `group` (None: the world), as a new tensor on the group's device.

    A tensor keeps its dtype (and is moved, not changed in place); Python numbers become float64.
    """
    device = group_device(group)
    if isinstance(values, torch.Tensor):
        tensor = values.detach().to(device, copy=True)
    else:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def reduce_values(values: Sequence[float], group: dist.ProcessGroup | None = None,
                  op: str = "sum") -> list[float]:
    """Python numbers reduced over `group`, as Python floats: one collective, one sync."""
    return all_reduce(values, group, op).tolist()


def broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank `src`'s `tensor` on every rank of `group`, as a new tensor on the group's device."""
    out = tensor.detach().to(group_device(group), copy=True)
    dist.broadcast(out, src=src, group=group)
    return out


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj` (pickled), in rank order; torch places the bytes on the group's device itself."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj` on rank `dst` (in rank order), None on the others."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, parts, dst=dst)
    return parts
