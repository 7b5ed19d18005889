"""`parallel.strategy: auto`: the layout `plan --search` ranks first on the world a run starts in.

Every rank chooses alike, before any process group exists (a plan makes a fake one): the search is
deterministic, so the target's figures must be too. On a GPU they come from the device's name and memory; on
the CPU the peak is a nominal 1 TFLOP/s (`clustertrain plan --peak-tflops 1` ranks alike), since a measured
CPU peak differs between ranks and only the ranking matters. The links are nominal (plan.target's CPU_LINKS and
GPU_LINKS): a run does not read its preset's hardware numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from clustertrain.config.schema import RunConfig
from clustertrain.errors import ConfigError


@dataclass(frozen=True)
class LayoutChoice:
    """The layout the planner chose: the config keys that make it (section -> keys, for RunConfig.updated,
    the parameter dtype it was planned with among them), and one line that says which and why."""

    overrides: dict
    line: str


def choose_layout(config: RunConfig, world: int, per_node: int, device_type: str | None) -> LayoutChoice:
    """The fastest layout of `config` that fits `world` ranks: each candidate is built and stepped on a fake rank.

    Raises:
        ConfigError: no layout fits, or none of the world runs the config (its batch, its heads).
    """
    from clustertrain.plan.search import search
    from clustertrain.plan.target import TargetRequest, target_for

    request = TargetRequest(world=world, ranks_per_node=per_node, peak_tflops=1.0 if device_type != "cuda" else None)
    target = target_for(config, request, device_type=device_type or "cpu")  # settles param_dtype auto
    device, dtype = target.device, target.config.parallel.param_dtype
    ranked = search(target.config.updated(parallel={"strategy": "zero3"}), world, per_node, device, keep=3).choices
    if not ranked:
        raise ConfigError(f"parallel.strategy = auto: no layout of this config fits {world} rank(s) of "
                          f"{device.name}; see `clustertrain plan CONFIG --world {world} --search`")
    best = ranked[0]
    others = "; next: " + " | ".join(c.describe() for c in ranked[1:]) if len(ranked) > 1 else ""
    line = (f"parallel.strategy auto chose {best.describe()} (planned: the fastest of {len(ranked)} layouts that "
            f"fit{others})")
    return LayoutChoice({**best.overrides, "parallel": {**best.overrides["parallel"], "param_dtype": dtype}}, line)

