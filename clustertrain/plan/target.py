"""Where a plan is for: the world size, the ranks per node, and the device, from the command line, the config's
slurm section and its preset's `hardware` numbers (clustertrain/launch/presets/*.yaml)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from clustertrain.config.schema import RunConfig
from clustertrain.errors import UserError
from clustertrain.plan.cost import Device


CPU_LINKS = (5e9, 1.25e9)  # assumed bytes/s of gloo between CPU ranks of a node (shared memory) and across (10 GbE)


@dataclass(frozen=True)
class Target:
    config: RunConfig  # param_dtype auto made what the target device runs
    world: int
    device: Device
    device_type: str
    where: str  # one phrase: "5,120 ranks (640 nodes × 8) of AMD MI250X GCD"


def target_for(config: RunConfig, args) -> Target:
    """The target of `clustertrain plan` (or of `parallel.strategy: auto`) from its arguments: world, nodes,
    gpus_per_node, preset, device_memory (GB), peak_tflops, efficiency; any may be None."""
    from clustertrain.launch.presets import load_preset

    preset_name = args.preset or config.slurm.preset
    preset = load_preset(preset_name) if preset_name else None
    hardware = preset.hardware if preset else None
    per_node = args.gpus_per_node or config.slurm.gpus_per_node or (preset.gpus_per_node if preset else 0)
    if args.world is not None:
        world = args.world
        per_node = per_node or world
    else:
        nodes = args.nodes or config.slurm.nodes
        if not nodes or not per_node:
            raise UserError("plan: give --world N, or --nodes N with ranks per node (--gpus-per-node, or a preset "
                            "with gpus_per_node)")
        world = nodes * per_node
    if world < 1 or per_node < 1:
        raise UserError(f"plan: --world/--nodes and --gpus-per-node must be at least 1 (got {world}, {per_node})")
    device_type = hardware.device_type if hardware else "cpu"
    if config.parallel.param_dtype == "auto" and hardware and "bfloat16" in hardware.peak_tflops:
        config = config.updated(parallel={"param_dtype": "bfloat16"})
    elif config.parallel.param_dtype == "auto":
        config = config.updated(parallel={"param_dtype": "float32"})
    dtype = config.parallel.param_dtype
    device = Device(
        name=hardware.device if hardware else "this machine's CPU",
        memory_bytes=_memory(args.device_memory, hardware, per_node),
        peak_flops=_peak(args.peak_tflops, hardware, dtype, per_node),
        intra_node_bps=hardware.intra_node_gbps * 1e9 if hardware else CPU_LINKS[0],
        inter_node_bps=hardware.inter_node_gbps * 1e9 if hardware else CPU_LINKS[1],
        per_node=per_node, efficiency=args.efficiency)
    nodes = f" ({world // per_node} nodes × {per_node})" if world % per_node == 0 and world > per_node else ""
    return Target(config, world, device, device_type, f"{world:,} ranks{nodes} of {device.name}")


def _memory(given_gb: float | None, hardware, per_node: int) -> float | None:
    if given_gb is not None:
        return given_gb * 1e9
    if hardware is not None:
        return hardware.memory_gb * 1e9
    try:  # a CPU rank's share of this machine's memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node
    except (ValueError, OSError):
        return None


def _peak(given_tflops: float | None, hardware, dtype: str, per_node: int) -> float | None:
    if given_tflops is not None:
        return given_tflops * 1e12
    if hardware is not None:
        tflops = hardware.peak_tflops.get(dtype)
        return tflops * 1e12 if tflops else None
    import torch

    from clustertrain.model.estimate import measure_cpu_peak

    return measure_cpu_peak(getattr(torch, dtype)) / per_node
