"""parallel.strategy's other names: those the DDP/ZeRO training stub gives our strategies, and its ZeRO stages."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

# Names other training scripts give our strategies (the DDP/ZeRO training stub's), read as ours.
STRATEGY_ALIASES = {"zero3_hybrid": "hybrid_zero3", "zero2_hybrid": "hybrid_zero2"}
SHARDING_STAGES = {0: "ddp", 2: "zero2", 3: "zero3"}  # DeepSpeed's ZeRO stages (stage 1 has no strategy of ours)
Strategy = Annotated[Literal["ddp", "zero2", "zero3", "hybrid_zero2", "hybrid_zero3", "auto"],
                     BeforeValidator(lambda v: STRATEGY_ALIASES.get(v, v) if isinstance(v, str) else v)]


def strategy_of_stage(stage: Any, hybrid: Any = False, prefix: str = "") -> str:
    """The strategy of a ZeRO `sharding_stage` (0, 2 or 3), hybrid (`zero3_hybrid: true`) or not; `prefix` is
    the keys' section in messages.

    Raises:
        ValueError: a stage or combination that is none of our strategies, naming what would fit.
    """
    if isinstance(stage, bool) or stage not in SHARDING_STAGES:
        fits = "; ZeRO-1 shards only optimizer states: zero2 (stage 2) shards them with the gradients" \
            if stage == 1 else ""
        raise ValueError(f"{prefix}sharding_stage = {stage!r}: use 0 (ddp), 2 (zero2) or 3 (zero3){fits}")
    if hybrid is not True and hybrid is not False:
        raise ValueError(f"{prefix}zero3_hybrid = {hybrid!r}: use true or false")
    if hybrid and stage != 3:
        raise ValueError(f"{prefix}zero3_hybrid with sharding_stage = {stage}: zero3_hybrid is a ZeRO-3 form; set "
                         "parallel.strategy: hybrid_zero2 for ZeRO-2 within a node")
    return f"hybrid_{SHARDING_STAGES[stage]}" if hybrid else SHARDING_STAGES[stage]


def read_stage_keys(data: Any) -> Any:
    """A parallel section's `sharding_stage` and `zero3_hybrid` (the training stub's keys) as the strategy they
    mean, in a section as given (before validation)."""
    if not isinstance(data, dict) or not {"sharding_stage", "zero3_hybrid"} & set(data):
        return data
    data = dict(data)
    stage, hybrid = data.pop("sharding_stage", None), data.pop("zero3_hybrid", False)
    if stage is None and not hybrid:
        return data  # zero3_hybrid: false alone says nothing
    stage = 3 if stage is None else stage
    strategy = strategy_of_stage(stage, hybrid, "parallel.")
    given = STRATEGY_ALIASES.get(data.get("strategy"), data.get("strategy"))
    if given is not None and given != strategy:
        raise ValueError(f"parallel.strategy = {given!r} and parallel.sharding_stage = {stage} (zero3_hybrid = "
                         f"{str(hybrid).lower()}, which means {strategy!r}) disagree; keep one")
    return {**data, "strategy": strategy}
