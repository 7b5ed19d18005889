"""The layouts a config could train with on a world, ranked by expected tokens/s among those that fit.

    ranked = search(config, world=16, per_node=8, device=device)   # best first in .choices; [] if none fits
    ranked.choices[0].plan.layout, ranked.choices[0].overrides       # what `parallel.strategy: auto` takes
    ranked.skipped       # one line, e.g. "skipped 90 layouts: 90 whose 512, 256 or 128 data-parallel ranks ..."

Candidates: every strategy (ddp, zero2, zero3, and the hybrids across nodes), tp inside a node, pp up to 4,
micro batches that divide a rank's share of the global batch, activation checkpointing none, selective or full; the
global batch, sequence length and everything else stay the config's. Each candidate's step is first costed
from the model's parameter count alone (`plan.cost`); they are then planned for real (`make_plan`: built and
stepped under a fake process group) in that order until `keep` fit, and those are ranked by their plans.
Layouts the config cannot run (a data-parallel degree that does not divide its global batch, a tp that does not
divide its heads) are skipped and counted in one line; a world where none runs is refused in one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from clustertrain.config.layout import Layout, apply_layout, check_world, global_batch_size, resolve_layout
from clustertrain.config.schema import RunConfig
from clustertrain.errors import ConfigError
from clustertrain.model.spec import model_shape
from clustertrain.plan.cost import Device
from clustertrain.plan.plan import Plan, make_plan

STRATEGIES = ("ddp", "zero2", "zero3", "hybrid_zero2", "hybrid_zero3")
CHECKPOINTING = ("none", "selective", "full")  # least recompute first


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


@dataclass(frozen=True)
class Candidates:
    """The layouts a search tries on a world, and those of the world it skipped because the config cannot run them.

    A layout is a strategy, tp, pp and checkpointing; each one tried comes with every micro batch that passes."""

    overrides: list[dict]  # section -> keys, for RunConfig.updated: one per layout and micro batch
    batch: int  # the global batch, in sequences
    undivided: dict[int, int]  # a data-parallel degree that does not divide the batch -> its layouts skipped
    refused: dict[str, list[str]]  # the key the run's own check named first -> its line, one per layout skipped

    def skipped_line(self) -> str | None:
        """How many layouts were skipped and why, in one line; None when none was."""
        count = sum(self.undivided.values()) + sum(len(lines) for lines in self.refused.values())
        if not count:
            return None
        parts = [f"{sum(self.undivided.values())} whose {_or(sorted(self.undivided, reverse=True))} data-parallel "
                 f"ranks do not divide the global batch of {self.batch:,} sequences"] if self.undivided else []
        parts += [f"{len(lines)} by {key} ({lines[0]})" for key, lines in self.refused.items()]
        return f"skipped {count} layouts: " + "; ".join(parts)

    def refusal(self, world: int) -> str:
        """Why no layout of `world` ranks runs the config: one line naming the key and what would fit."""
        lines = max(self.refused.values(), key=len, default=[])
        if len(lines) > sum(self.undivided.values()):
            return f"no layout runs this config on {world} ranks: {lines[0]}"
        least = min(self.undivided)  # a multiple of it fits at least that degree's layouts
        near = sorted({max(least, self.batch // least * least), (self.batch // least + 1) * least})
        return (f"train.global_batch_size = {self.batch:,} does not divide among the data-parallel ranks of any "
                f"layout on {world} ranks ({_or(sorted(self.undivided, reverse=True))}); use a multiple of {least} "
                f"({' or '.join(f'{n:,}' for n in near)})")


@dataclass(frozen=True)
class Ranked:
    """What a search found: the layouts that fit, fastest first, and one line on those it skipped (None: none)."""

    choices: list[Choice]
    skipped: str | None


def candidates(config: RunConfig, world: int, per_node: int) -> Candidates:
    """Overrides of every layout of `config` on `world` ranks that passes the run's own checks, and why the
    others of the world do not."""
    shape = model_shape(config.model, config.data.vocab_size)
    batch = global_batch_size(config.train, world)  # with grad_accum: micro batch × accumulation × all ranks
    found: list[dict] = []
    undivided: dict[int, int] = {}
    refused: dict[str, list[str]] = {}
    for strategy, tp, pp, ac in itertools.product(STRATEGIES, (1, 2, 4, 8), (1, 2, 4), CHECKPOINTING):
        if tp > per_node or world % (tp * pp) or (strategy.startswith("hybrid") and world <= per_node):
            continue  # not a layout of this world
        dp = world // (tp * pp)
        if batch % dp:
            undivided[dp] = undivided.get(dp, 0) + 1
            continue
        rows = batch // dp
        first = [f"parallel.pp = {pp} stages, but each data-parallel rank gets {rows} sequences a step: fewer "
                 "microbatches than stages"] if pp > rows else []
        tried = len(found)
        for micro in sorted({1, 2, 4, 8, rows} & set(range(1, rows + 1))):
            if rows % micro or (pp > 1 and rows // micro < pp):
                continue
            overrides = {
                "parallel": {"strategy": strategy, "tp": tp, "pp": pp, "dp_shard": None, "dp_replicate": None,
                             "activation_checkpoint": ac, "microbatches": rows // micro if pp > 1 else None},
                "train": {"global_batch_size": batch, "grad_accum": None, "micro_batch_size": micro},
            }
            problems = check_world(config.updated(**overrides), world, per_node, shape)
            if problems:
                first = first or problems
            else:
                found.append(overrides)
        if len(found) == tried:  # no micro batch passed: the first problem met says why
            refused.setdefault(first[0].split(" ", 1)[0].rstrip(":"), []).append(first[0])
    return Candidates(found, batch, undivided, refused)


def _or(numbers: list[int]) -> str:
    """The numbers in words, e.g. 512, 256 or 128."""
    return ", ".join(map(str, numbers[:-1])) + (" or " if len(numbers) > 1 else "") + str(numbers[-1])


def search(config: RunConfig, world: int, per_node: int, device: Device, keep: int = 5) -> Ranked:
    """The layouts of `config` on `world` ranks that fit `device`, fastest first (at most `keep`).

    Raises:
        ConfigError: no layout of the world passes the run's checks (one line naming the key and what would fit).
    """
    tried = candidates(config, world, per_node)
    costed = []
    for overrides in tried.overrides:
        candidate = config.updated(**overrides)
        layout = resolve_layout(candidate, world, per_node)
        costed.append((overrides, apply_layout(candidate, layout), layout))
    if not costed:
        raise ConfigError(tried.refusal(world))
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
    return Ranked(sorted(fitting, key=lambda c: -(c.plan.tokens_per_s or 0)), tried.skipped_line())


def _rough_order(config: RunConfig, layout: Layout) -> tuple:
    """Likely fastest first, before any is built: less model parallelism, no recompute, larger micro batches,
    less data-parallel traffic (ddp and zero2 send the weights once, zero3 twice)."""
    p = config.parallel
    traffic = {"ddp": 0, "zero2": 1, "hybrid_zero2": 1, "zero3": 2, "hybrid_zero3": 2}[p.strategy]
    return (CHECKPOINTING.index(p.activation_checkpoint), p.tp * p.pp, -layout.micro_batch, traffic)


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
