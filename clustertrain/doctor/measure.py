"""What `clustertrain doctor` measures on every rank: a matmul, links to the neighbouring ranks, and each mesh
dimension's collectives; and the rule that names a slow rank.

    seconds = time_matmul(device, rank)                     # best of a few, on this rank's device
    slow_ranks([1.0, 1.1, 3.0], threshold=1.25)             # [2]: slower than the median by more than 25%
    link = time_links(rank, world, nbytes)                  # ping-pong with each ring neighbour, in rounds
    busbw = measure_dims(mesh, sizes)                       # all-reduce / all-gather bus bandwidth per dimension

All ranks of a collective see the same time, so a collective cannot tell which rank held it up. The links are
measured in ping-pong rounds between ring neighbours instead: each rank times its own turn (from the message it
received to its reply sent), which a slow rank or NIC lengthens, and the round trip of each pair, which a slow
link lengthens.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from clustertrain.config.layout import DIMS
from clustertrain.distributed import faults
from clustertrain.distributed.collectives import time_collective, time_exchange
from clustertrain.distributed.mesh import Mesh


def slow_ranks(seconds: list[float], threshold: float, noise: float = 0.0) -> list[int]:
    """The indices whose time exceeds the median of all by more than `threshold` (1.25: 25% slower) and by more
    than `noise` seconds (noise_floor: what the timer and scheduler alone make of a difference)."""
    median = statistics.median(seconds)
    return [i for i, s in enumerate(seconds) if s > threshold * median and s - median > noise]


def noise_floor(device: torch.device) -> float:
    """Seconds by which ranks may differ without being slow: a GPU's timings (synchronized) are exact to some
    microseconds; CPU ranks share cores with each other and other processes, whose scheduling moves a
    millisecond-long timing by as much again."""
    return 1e-4 if device.type == "cuda" else 2e-3


def matmul_size(device: torch.device) -> tuple[int, torch.dtype]:
    """The side and dtype of the timed matmul: seconds of work on a GPU, milliseconds on a CPU."""
    return (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)


def time_matmul(device: torch.device, rank: int, repeats: int = 10) -> float:
    """Seconds of one n x n matmul on `device` (the best of `repeats`, after a warm-up): the best run is the one
    other processes disturbed least, and a slow device is slow in every run."""
    n, dtype = matmul_size(device)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        faults.delay("matmul", rank)
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def ring_rounds(world: int) -> list[list[tuple[int, int]]]:
    """The links between ring neighbours (r, r + 1), in rounds where no rank is in two: 2 rounds (3 for an odd
    ring of 3 or more), so the whole ring is measured in constant time at any size."""
    if world < 2:
        return []
    if world == 2:
        return [[(0, 1)]]
    rounds: list[list[tuple[int, int]]] = [[], [], []]
    for r in range(world):
        rounds[2 if world % 2 and r == world - 1 else r % 2].append((r, (r + 1) % world))
    return [links for links in rounds if links]


def time_links(rank: int, world: int, nbytes: int, repeats: int = 10) -> dict:
    """This rank's ping-pongs with its ring neighbours: {"turn": its slower own turn (s), "links": {(a, b):
    round trip (s)} of the links it sent first on} (collectives.time_exchange: the fastest of `repeats`)."""
    turns, links = [], {}
    for round_links in ring_rounds(world):
        for a, b in round_links:
            if rank in (a, b):
                trip, turn = time_exchange(b if rank == a else a, nbytes, first=rank == a, repeats=repeats,
                                           before=lambda: faults.delay("network", rank))
                turns.append(turn)
                if rank == a:
                    links[a, b] = trip
    return {"turn": max(turns, default=0.0), "links": links}


def measure_dims(mesh: Mesh, sizes: list[int], rank: int, repeats: int = 5) -> list[dict]:
    """This rank's view of each mesh dimension of more than one rank: for each size and collective, the seconds
    and the bus bandwidth (nccl-tests' busbw: all-reduce bytes/t x 2(n-1)/n, all-gather bytes/t x (n-1)/n)."""
    rows = []
    for dim in DIMS:
        n = mesh.device_mesh.size(DIMS.index(dim))
        if n < 2:
            continue
        group = mesh.device_mesh.get_group(dim)
        for nbytes in sizes:
            for kind, factor in (("all_reduce", 2 * (n - 1) / n), ("all_gather", (n - 1) / n)):
                seconds = time_collective(kind, nbytes, group, repeats, before=lambda: faults.delay("network", rank))
                rows.append({"dim": dim, "ranks": n, "kind": kind, "bytes": nbytes, "seconds": seconds,
                             "busbw": nbytes / seconds * factor, "group": dist.get_process_group_ranks(group)})
    return rows
