"""Where a plan is for: the world size, the ranks per node, and the device, from a request (the command line's
flags, or a run's own world) and the hardware of a preset (`clustertrain/launch/presets/*.yaml`, read by the
caller) or the node's own device; the device's figures come from the hardware catalogue (`clustertrain/hardware.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from clustertrain.config.schema import RunConfig
from clustertrain.errors import UserError
from clustertrain.hardware import EFFICIENCY, Accelerator, find, param_dtype_for
from clustertrain.plan.cost import Device

# assumed bytes/s per direction where no preset gives them: gloo between CPU ranks of a node (shared memory) and
# across nodes (10 GbE); GPUs inside a node and across (a PCIe-class link, one 100 Gb/s NIC per GPU)
CPU_LINKS = (5e9, 1.25e9)
GPU_LINKS = (50e9, 12.5e9)


@dataclass(frozen=True)
class TargetRequest:
    """What a plan is asked to target; each None: from the config, the preset or the device."""

    world: int | None = None  # ranks in all; else nodes × ranks_per_node
    nodes: int | None = None
    ranks_per_node: int | None = None
    device_memory_gb: float | None = None  # decimal GB per rank
    peak_tflops: float | None = None  # the device's peak at the run's compute dtype
    efficiency: float | None = None  # the fraction of the peak the matmuls reach


@dataclass(frozen=True)
class Target:
    config: RunConfig  # param_dtype auto made what the target device runs
    world: int
    device: Device
    device_type: str
    where: str  # one phrase: "5,120 ranks (640 nodes × 8) of AMD MI250X GCD"


def target_for(config: RunConfig, request: TargetRequest, hardware=None, device_type: str = "cpu") -> Target:
    """The target of a plan from `request` and a preset's `hardware` (launch.presets.Hardware), else this node's
    `device_type` ("cuda": its first GPU's name and memory, nominal links; "cpu": this machine standing for one
    node, its memory and measured peak shared by the ranks of a node, never by the whole world).

    Raises:
        UserError: neither a world nor nodes with ranks per node, or one below 1.
    """
    per_node = request.ranks_per_node or config.slurm.gpus_per_node or 0
    if request.world is not None:
        world = request.world
        per_node = per_node or world
    else:
        nodes = request.nodes or config.slurm.nodes
        if not nodes or not per_node:
            raise UserError("plan: give --world N, or --nodes N with ranks per node (--gpus-per-node, or a preset "
                            "with gpus_per_node)")
        world = nodes * per_node
    if world < 1 or per_node < 1:
        raise UserError(f"plan: --world/--nodes and --gpus-per-node must be at least 1 (got {world}, {per_node})")
    if hardware is not None:
        device_type = hardware.device_type
    gpu = _local_gpu() if device_type == "cuda" and hardware is None else None
    preset_device = hardware.accelerator if hardware else None
    # bf16 on a preset's device as the catalogue (or the preset's numbers) says; on this node's GPU as torch says,
    # which is what a run on it asks
    dtype = param_dtype_for(config.parallel.param_dtype, device_type, preset_device)
    known = preset_device or (find(gpu[0]) if gpu else None)
    config = config.updated(parallel={"param_dtype": dtype})
    links = ((hardware.intra_node_gbps * 1e9, hardware.inter_node_gbps * 1e9) if hardware
             else GPU_LINKS if gpu else CPU_LINKS)
    name = hardware.device if hardware else gpu[0] if gpu else "this machine's CPU"
    device = Device(name=name, memory_bytes=_memory(request.device_memory_gb, hardware, gpu, per_node),
                    peak_flops=_peak(request.peak_tflops, known, gpu, dtype, per_node),
                    intra_node_bps=links[0], inter_node_bps=links[1], per_node=per_node,
                    efficiency=request.efficiency or (known.efficiency if known else EFFICIENCY))
    nodes = f" ({world // per_node} nodes × {per_node})" if world % per_node == 0 and world > per_node else ""
    return Target(config, world, device, device_type, f"{world:,} ranks{nodes} of {device.name}")


def _local_gpu() -> tuple[str, int]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory


def _memory(given_gb: float | None, hardware, gpu, per_node: int) -> float | None:
    if given_gb is not None:
        return given_gb * 1e9
    if hardware is not None:
        return hardware.memory_gb * 1e9
    if gpu is not None:
        return gpu[1]
    try:  # a CPU rank's share of this machine's memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node
    except (ValueError, OSError):
        return None


def _peak(given_tflops: float | None, known: Accelerator | None, gpu, dtype: str, per_node: int) -> float | None:
    if given_tflops is not None:
        return given_tflops * 1e12
    if known is not None or gpu is not None:  # a preset's device, or this node's GPU the catalogue may know
        return known.peak_flops(dtype) if known else None
    import torch

    from clustertrain.model.estimate import measure_cpu_peak

    return measure_cpu_peak(getattr(torch, dtype)) / per_node  # a node's ranks split its cores
