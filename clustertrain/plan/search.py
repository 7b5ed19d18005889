"""The layouts a config could train with on a world, ranked by expected tokens/s among those that fit.

    ranked = search(config, world_size=16, per_node=8, device=device)   # best first; [] if none fits
    ranked[0].plan.layout, ranked[0].overrides                            # what `parallel.strategy: auto` takes

Candidates: every strategy (ddp, zero2, zero3, and the hybrids across nodes), tp inside a node, pp up to 4,
micro batches that divide a rank's share of the global batch, activation checkpointing none or full; the
global batch, sequence length and everything else stay the config's. Each candidate's step is first costed
from the model's parameter count alone (`plan.cost`); they are then planned for real (`make_plan`: built and
stepped under a fake process group) in that order until `keep` fit, and those are ranked by their plans.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from clustertrain.config.layout import Layout, apply_layout, check_world, resolve_layout
from clustertrain.config.schema import RunConfig
from clustertrain.errors import UserError
from clustertrain.model.spec import model_shape
from clustertrain.plan.cost import Device
from clustertrain.plan.plan import Plan, make_plan

STRATEGIES = ("ddp", "zero2", "zero3", "hybrid_zero2", "hybrid_zero3")


@dataclass(frozen=True)
class Choice:
    """A layout that fits, the config keys that make it, and its plan."""

    overrides: dict  # section -> keys, for RunConfig.updated
    plan: Plan

    def describe(self) -> str:
        p = self.plan.config.parallel
        micro = self.plan.layout.micro_batch
        keys = [p.strategy] + [f"{k} {getattr(p, k)}" for k in ("tp", "pp") if getattr(p, k) > 1]
        keys += [f"micro batch {micro}", f"checkpointing {p.activation_checkpoint}"]
        speed = f"{self.plan.tokens_per_s:,.0f} tokens/s" if self.plan.tokens_per_s else "speed unknown"
        return f"{', '.join(keys)}: {speed}, peak {self.plan.peak_bytes / 1e9:.2f} GB a rank"


def candidates(config: RunConfig, world: int, per_node: int) -> list[dict]:
    """Overrides of every layout of `config` on `world` ranks that passes the run's own checks."""
    shape = model_shape(config.model, config.data.vocab_size)
    base = resolve_layout(config.updated(parallel={"strategy": "ddp", "tp": 1, "pp": 1, "dp_shard": None,
                                                   "dp_replicate": None, "microbatches": None}), world, per_node)
    batch = base.global_batch
    found = []
    for strategy, tp, pp, ac in itertools.product(STRATEGIES, (1, 2, 4, 8), (1, 2, 4), ("none", "full")):
        if tp > per_node or world % (tp * pp) or (strategy.startswith("hybrid") and world <= per_node):
            continue
        dp = world // (tp * pp)
        if batch % dp:
            continue
        rows = batch // dp
        for micro in sorted({1, 2, 4, 8, rows} & set(range(1, rows + 1))):
            if rows % micro or (pp > 1 and rows // micro < pp):
                continue
            overrides = {
                "parallel": {"strategy": strategy, "tp": tp, "pp": pp, "dp_shard": None, "dp_replicate": None,
                             "activation_checkpoint": ac, "microbatches": rows // micro if pp > 1 else None},
                "train": {"global_batch_size": batch, "grad_accum": None, "micro_batch_size": micro},
            }
            candidate = config.updated(**overrides)
            if not check_world(candidate, world, per_node, shape):
                found.append(overrides)
    return found


def search(config: RunConfig, world: int, per_node: int, device: Device, keep: int = 5) -> list[Choice]:
    """The layouts of `config` on `world` ranks that fit `device`, fastest first (at most `keep`)."""
    costed = []
    for overrides in candidates(config, world, per_node):
        candidate = config.updated(**overrides)
        layout = resolve_layout(candidate, world, per_node)
        costed.append((overrides, apply_layout(candidate, layout), layout))
    if not costed:
        raise UserError(f"plan --search: no layout of this config passes its checks on {world} ranks")
    total, trainable = _param_counts(config)
    fitting: list[Choice] = []
    for overrides, candidate, layout in sorted(costed, key=lambda c: _rough_order(c[1], c[2])):
        if device.memory_bytes and _state_floor(layout, total, trainable) > device.memory_bytes:
            continue  # its weights and AdamW states alone do not fit: not worth building
        plan = make_plan(candidate, layout, per_node, device)
        if plan.fits:
            fitting.append(Choice(overrides, plan))
        if len(fitting) == keep:
            break
    return sorted(fitting, key=lambda c: -(c.plan.tokens_per_s or 0))


def _rough_order(config: RunConfig, layout: Layout) -> tuple:
    """Likely fastest first, before any is built: less model parallelism, no recompute, larger micro batches,
    less data-parallel traffic (ddp and zero2 send the weights once, zero3 twice)."""
    p = config.parallel
    traffic = {"ddp": 0, "zero2": 1, "hybrid_zero2": 1, "zero3": 2, "hybrid_zero3": 2}[p.strategy]
    return (p.activation_checkpoint != "none", p.tp * p.pp, -layout.micro_batch, traffic)


def _param_counts(config: RunConfig) -> tuple[int, int]:
    """The model's parameters and trainable parameters (built on the meta device)."""
    import torch

    from clustertrain.model.build import build_model
    from clustertrain.model.estimate import count_params

    built = build_model(config.model, config.lora, None, config.data.vocab_size, param_dtype=torch.float32,
                        device=torch.device("cpu"), loss=config.train.loss,
                        loss_chunk_tokens=config.train.loss_chunk_tokens)
    counts = count_params(built.model)
    return counts["total"], counts["trainable"]


def _state_floor(layout: Layout, total: int, trainable: int) -> float:
    """Bytes a rank holds at least: float32 weights, and for trainable ones a gradient and two AdamW moments,
    split over tp and (under FSDP) dp_shard."""
    split = layout.degree("tp") * (layout.degree("dp_shard") if layout.wrapper == "fsdp" else 1)
    return (4 * total + 12 * trainable) / split
