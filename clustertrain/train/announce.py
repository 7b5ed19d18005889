"""What a run says when it starts (rank 0): the model, the ranks and layout, the batch arithmetic, the budget."""

from __future__ import annotations

from pathlib import Path

from clustertrain.config.schema import RunConfig
from clustertrain.train.parts import DataParts, ModelParts, Optimization, Place


def start_lines(cfg: RunConfig, place: Place, data: DataParts, model: ModelParts, optim: Optimization,
                choice: str | None, total_steps: int, step: int, resumed: Path | None, stop_reason: str | None
                ) -> list[str]:
    """The start lines of a built run about to train `total_steps` from `step`, resumed from `resumed`;
    `choice` is parallel.strategy auto's line, `stop_reason` a stop request that came while it started."""
    layout, info, p = place.layout, place.info, model.params
    pp, replicate, shard, tp = (layout.degree(dim) for dim in ("pp", "dp_replicate", "dp_shard", "tp"))
    lines = [
        f"clustertrain: {model.hf_config.model_type} {p['total'] / 1e6:.2f}M params "  # the family built
        f"({p['trainable'] / 1e6:.2f}M trainable), "
        f"{info.world_size} rank(s) on {info.world_size // info.local_world_size} node(s) "
        f"via {info.launcher} on {place.device.type}, "
        f"{cfg.parallel.strategy} (dp_replicate={replicate}, dp_shard={shard}, tp={tp}{model.runner.describe()})"
    ]
    capped = (f", train.micro_batch_size {cfg.train.micro_batch_size} capped at a rank's share"
              if cfg.train.micro_batch_size > layout.micro_batch and pp == 1 else "")
    epochs = f" ({cfg.train.epochs:g} epochs of {data.epoch_steps} steps)" if data.epoch_steps else ""
    fused = "fused" if optim.optimizer.param_groups[0].get("fused") else "foreach"
    tokens = cfg.tokens_per_step
    lines.append(
        f"batch: {cfg.train.global_batch_size} seq x {cfg.data.seq_len} tokens = {tokens} tokens/step "
        f"({layout.dp} ranks x {cfg.train.global_batch_size // layout.dp} seq, micro {layout.micro_batch}{capped}); "
        f"{total_steps} steps = {total_steps * tokens / 1e6:.2f}M tokens{epochs}; "
        f"AdamW {fused}, {model.attention} attention, {model.loss_kind} loss"
    )
    lines += [*([choice] if choice else []), *model.notes, *data.plan.notes]
    lines.append(f"resuming from {resumed} at step {step}" if resumed
                 else f"starting fresh in {cfg.run_dir} (no checkpoint to resume)")
    if stop_reason:
        lines.append(f"{stop_reason} arrived while the run was starting: it saves and stops after step {step + 1}")
    return lines
