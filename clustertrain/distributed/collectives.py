"""The collectives clustertrain itself calls, on tensors built on the device of the group's backend.

An NCCL group (RCCL on ROCm) has no CPU backend: a scalar made with `torch.tensor(...)` lands on the CPU
and fails there with "No backend type associated with device type cpu"; a gloo group takes CPU tensors.
So every count, loss, norm, memory figure and stop flag that ranks agree on goes through this module,
which builds its tensors on `group_device(group)`; no other module calls a torch.distributed collective
on a tensor it built itself (tests/unit/distributed/test_collectives.py reads the package's source to keep it so).

    set_rank_device(device)                               # once, when the process group starts
    tokens = all_reduce(local_tokens, group=mesh.dp_group)  # a tensor on the group's device
    peak_gb, = reduce_values([memory_gb], op="max")        # Python numbers in, Python floats out
    seconds = time_collective("all_reduce", 2**20, group)   # `clustertrain doctor`'s bus bandwidth
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
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


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `tensor` (same shape on each), concatenated in rank order (0-d tensors stacked), on the
    group's device."""
    local = tensor.detach().to(group_device(group)).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts) if local.dim() == 0 else torch.cat(parts)


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


# ---- timed collectives, for `clustertrain doctor` (clustertrain/doctor/measure.py) ----

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collective(kind: str, nbytes: int, group: dist.ProcessGroup | None = None, repeats: int = 5,
                    before: Callable[[], None] = lambda: None) -> float:
    """Median seconds of one `kind` ("all_reduce" or "all_gather") of `nbytes` in all over `group` (all_gather:
    the gathered tensor, each rank adding its share), on the group's device, after one untimed warm-up.
    `before` runs ahead of each timed call (a test's injected fault)."""
    device, size = group_device(group), dist.get_world_size(group)
    numel = max(1, nbytes // 4 // size) * (size if kind == "all_gather" else 1)
    out = torch.zeros(numel, dtype=torch.float32, device=device)
    part = out[: numel // size] if kind == "all_gather" else out
    # all_gather_single replaces all_gather_into_tensor in newer torch (which warns of the old name)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    call = (lambda: dist.all_reduce(out, group=group)) if kind == "all_reduce" else (
        lambda: gather(out, part.clone(), group=group))
    call()
    seconds = []
    for _ in range(repeats):
        before()
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def time_exchange(peer: int, nbytes: int, first: bool, repeats: int = 10,
                  before: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """Ping-pong `nbytes` with global rank `peer` (`first`: this rank sends first) on this rank's device: the
    fastest (round trip, own turn: `before` and this rank's send) in seconds, after one untimed warm-up. The
    fastest, because other processes only ever add time; a slow link or NIC is slow every time."""
    device = _rank_device
    buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    trips, turns = [], []
    for i in range(repeats + 1):
        if not first:
            dist.recv(buffer, src=peer)
        _sync(device)
        start = time.perf_counter()
        if i:
            before()
        dist.send(buffer, dst=peer)
        _sync(device)
        sent = time.perf_counter()
        if first:
            dist.recv(buffer, src=peer)
            _sync(device)
        if i:
            turns.append(sent - start)
            trips.append(time.perf_counter() - start)
    return min(trips), min(turns)
