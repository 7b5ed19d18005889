"""Start the process group: pick the device and backend, set CPU threads, apply the timeout."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.collectives import set_rank_device
from clustertrain.distributed.env import RankInfo
from clustertrain.errors import ConfigError, LaunchError


def device_type(parallel: ParallelConfig) -> str:
    """"cuda" where `parallel.device` asks for GPUs or (auto) torch sees one (ROCm builds report as cuda too)."""
    return "cuda" if parallel.device == "cuda" or (parallel.device == "auto" and torch.cuda.is_available()) else "cpu"


def pick_device(parallel: ParallelConfig, info: RankInfo) -> torch.device:
    """cuda:<local rank> on GPU nodes, else cpu."""
    if device_type(parallel) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("parallel.device = 'cuda' but this torch build sees no GPU; use auto or cpu")
    return torch.device("cuda", info.local_rank % torch.cuda.device_count())


def init_distributed(parallel: ParallelConfig, info: RankInfo, run_dir: Path | None = None) -> torch.device:
    """Initialize torch.distributed for this rank (also for a single process) and return its device.

    On a GPU, float32 matmuls use TF32 tensor cores, and NCCL's flight recorder (when the job turned it on with
    TORCH_NCCL_TRACE_BUFFER_SIZE, as the GPU presets do) dumps its trace on a timeout into `run_dir` as
    nccl-trace-rank_<rank>, for `python -m torch.distributed.flight_recorder.fr_trace`.
    """
    device = pick_device(parallel, info)
    backend = parallel.backend if parallel.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend = 'nccl' needs GPUs; use gloo (or auto) on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32: fp32 work without it runs at a fraction of the peak
        if run_dir is not None and backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(Path(run_dir).resolve() / "nccl-trace-rank_"))
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one node share its cores; oversubscribing them slows every rank down.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // info.local_world_size))
    set_rank_device(device)
    # device_id binds NCCL to this rank's GPU (no "guessing device ID" and eager communicator setup), also alone
    options = {"timeout": timedelta(minutes=parallel.timeout_minutes), "device_id": device if backend == "nccl" else None}
    if info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    else:
        try:
            dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                    rank=info.rank, world_size=info.world_size, **options)
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            # Rank 0 hosts the store on MASTER_PORT: another run (or program) listens there already.
            raise LaunchError(f"MASTER_PORT {info.master_port} is already in use on {info.master_addr} (EADDRINUSE: "
                              "another run or program listens there); set MASTER_PORT to a free port") from None
    return device


def close_distributed() -> None:
    """Tear the process group down if one is up."""
    if dist.is_initialized():
        dist.destroy_process_group()
