"""`parallel.strategy: auto`: the layout `plan --search` ranks first on the world a run starts in.

Every rank chooses alike, before any process group exists (a plan makes a fake one): the search is
deterministic, so the target's figures must be too. On a GPU they come from the device's name and memory; on
the CPU the peak is a nominal 1 TFLOP/s (`clustertrain plan --peak-tflops 1` ranks alike), since a measured
CPU peak differs between ranks and only the ranking matters. Links are a preset's where the config's
`slurm.preset` has `hardware:`, else nominal (CPU: plan.target.CPU_LINKS; GPU: 50 GB/s inside a node, 12.5
GB/s across).
"""

from __future__ import annotations

from types import SimpleNamespace

from clustertrain.config.schema import RunConfig
from clustertrain.errors import ConfigError
from clustertrain.plan.cost import Device


def choose_layout(config: RunConfig, world: int, per_node: int, device_type: str | None) -> tuple[RunConfig, str]:
    """`config` with the fastest layout that fits, and one line that says which and why.

    Raises:
        ConfigError: no layout fits.
    """
    from clustertrain.plan.search import search
    from clustertrain.plan.target import target_for

    target = target_for(config, SimpleNamespace(world=world, nodes=None, gpus_per_node=per_node, preset=None,
                                                device_memory=None, peak_tflops=1.0, efficiency=0.5))
    device = target.device
    if device_type == "cuda" and target.device_type == "cpu":  # no GPU preset: this node's GPU, nominal links
        device = _gpu(per_node)
    ranked = search(target.config.updated(parallel={"strategy": "zero3"}), world, per_node, device, keep=3)
    if not ranked:
        raise ConfigError(f"parallel.strategy = auto: no layout of this config fits {world} rank(s) of "
                          f"{device.name}; see `clustertrain plan CONFIG --world {world} --search`")
    best = ranked[0]
    others = "; next: " + " | ".join(c.describe() for c in ranked[1:]) if len(ranked) > 1 else ""
    line = (f"parallel.strategy auto chose {best.describe()} (planned: the fastest of {len(ranked)} layouts that "
            f"fit{others})")
    return config.updated(**best.overrides), line


def _gpu(per_node: int) -> Device:
    """The figures of this node's GPU, the same on every rank, with nominal links."""
    import torch

    from clustertrain.model.estimate import peak_flops_for_name

    props = torch.cuda.get_device_properties(0)
    peak = peak_flops_for_name(props.name, torch.bfloat16) or 1e14
    return Device(props.name, props.total_memory, peak, 50e9, 12.5e9, per_node)
