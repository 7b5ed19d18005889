"""`parallel.strategy: auto`: the layout `plan --search` ranks first on the world a run starts in.

Every rank chooses alike, before any process group exists (a plan makes a fake one): the search is
deterministic, so the target's figures must be too. On a GPU they come from the device's name and memory; on
the CPU the peak is a nominal 1 TFLOP/s (`clustertrain plan --peak-tflops 1` ranks alike), since a measured
CPU peak differs between ranks and only the ranking matters. The links are nominal (plan.target's CPU_LINKS and
GPU_LINKS): a run does not read its preset's hardware numbers.
"""

from __future__ import annotations

from types import SimpleNamespace

from clustertrain.config.schema import RunConfig
from clustertrain.errors import ConfigError


def choose_layout(config: RunConfig, world: int, per_node: int, device_type: str | None) -> tuple[RunConfig, str]:
    """`config` with the fastest layout that fits, and one line that says which and why.

    Raises:
        ConfigError: no layout fits.
    """
    from clustertrain.parallel.apply import resolve_param_dtype
    from clustertrain.plan.search import search
    from clustertrain.plan.target import target_for

    dtype = resolve_param_dtype(config.parallel.param_dtype, device_type or "cpu")
    config = config.updated(parallel={"param_dtype": dtype})
    args = SimpleNamespace(world=world, nodes=None, gpus_per_node=per_node, device_memory=None,
                           peak_tflops=1.0 if device_type != "cuda" else None, efficiency=0.5)
    target = target_for(config, args, device_type=device_type or "cpu")
    device = target.device
    ranked = search(target.config.updated(parallel={"strategy": "zero3"}), world, per_node, device, keep=3)
    if not ranked:
        raise ConfigError(f"parallel.strategy = auto: no layout of this config fits {world} rank(s) of "
                          f"{device.name}; see `clustertrain plan CONFIG --world {world} --search`")
    best = ranked[0]
    others = "; next: " + " | ".join(c.describe() for c in ranked[1:]) if len(ranked) > 1 else ""
    line = (f"parallel.strategy auto chose {best.describe()} (planned: the fastest of {len(ranked)} layouts that "
            f"fit{others})")
    return config.updated(**best.overrides), line

