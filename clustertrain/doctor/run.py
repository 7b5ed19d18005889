"""One rank of `clustertrain doctor`: the run's layout and process group, this rank's checks and timings, every
rank's record gathered, the verdict (the same on every rank, so every rank exits with it), rank 0's report."""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path

import torch
import torch.distributed as dist

from clustertrain.config.schema import RunConfig
from clustertrain.distributed.collectives import all_gather_objects
from clustertrain.distributed.env import RankInfo, detect_launcher, node_name
from clustertrain.distributed.init import close_distributed, device_type, init_distributed
from clustertrain.distributed.mesh import build_mesh
from clustertrain.doctor.checks import local_checks
from clustertrain.doctor.measure import matmul_size, measure_dims, noise_floor, time_links, time_matmul
from clustertrain.doctor.report import diagnose, print_report
from clustertrain.files import write_atomic
from clustertrain.resolve.run import resolve


def sizes(device: torch.device) -> tuple[int, list[int]]:
    """Bytes of the ping-pong, and of the collectives per mesh dimension: small on a CPU, GPU-sized on a GPU."""
    if device.type == "cuda":
        return 2**26, [2**20, 2**26, 2**28]
    return 2**22, [2**16, 2**20]


def run_doctor(config: RunConfig, config_path: str | None, threshold: float, as_json: bool,
               output: Path | None) -> int:
    """Check and measure this rank with the others; returns 0 when everything passed, 1 otherwise."""
    info = detect_launcher()
    kind = device_type(config.parallel)
    run = resolve(config, info.world_size, info.local_world_size, kind)
    planned = None
    if kind == "cuda" and info.rank == 0:
        from clustertrain.train.plan_check import plan_run

        plan = plan_run(run, info.local_world_size)
        planned = plan["peak_bytes"] if plan else None
    device = init_distributed(run.config.parallel, info)
    try:
        mesh = build_mesh(run.layout, device.type)
        record = measure_rank(run.config, config_path, info, device, mesh)
        record["planned_peak"] = planned
        records = all_gather_objects(record)
    finally:
        close_distributed()
    result = diagnose(records, threshold)
    if info.rank == 0:
        if output is not None:
            output.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(output, json.dumps(result, indent=1))
        if as_json:
            print(json.dumps(result, indent=1), flush=True)
        else:
            print_report(result)
    return 0 if result["ok"] else 1


def measure_rank(config: RunConfig, config_path: str | None, info: RankInfo, device: torch.device, mesh) -> dict:
    """This rank's record (see doctor.report): its facts and checks, then its timings, each phase begun together so
    that one rank's checks do not slow another's timings."""
    link_bytes, dim_bytes = sizes(device)
    findings = local_checks(config, config_path, files=info.local_rank == 0)  # files: once per node
    dist.barrier()
    matmul_s = time_matmul(device, info.rank)
    dist.barrier()
    links = time_links(info.rank, info.world_size, link_bytes)
    dims = measure_dims(mesh, dim_bytes, info.rank)
    n, dtype = matmul_size(device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return {"rank": info.rank, "host": node_name(), "facts": facts(device), "free_memory": free,
            "findings": [dataclasses.asdict(f) for f in findings], "matmul_s": matmul_s,
            "matmul_size": (n, str(dtype).removeprefix("torch.")), "link_bytes": link_bytes, "turn_s": links["turn"],
            "links": {f"{a}-{b}": s for (a, b), s in links["links"].items()}, "dims": dims,
            "noise_s": noise_floor(device)}


def facts(device: torch.device) -> dict:
    """The versions and hardware that every rank must share with rank 0."""
    import transformers

    from clustertrain import __version__

    gpu = device.type == "cuda"
    runtime = (f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}") if gpu else None
    nccl = None
    if gpu and dist.is_nccl_available():  # RCCL's on ROCm; a tuple in recent torch, an int in old ones
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"python": platform.python_version(), "torch": torch.__version__, "gpu runtime": runtime, "nccl": nccl,
            "transformers": transformers.__version__, "clustertrain": __version__,
            "device": torch.cuda.get_device_name(device) if gpu else "cpu", "backend": dist.get_backend()}
