"""What a run says when it starts (rank 0): the model, the ranks and layout, the batch arithmetic, the budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def start_lines(trainer: Any, resumed: Path | None) -> list[str]:
    """The start lines of a built `clustertrain.train.trainer.Trainer` about to train, resumed from `resumed`."""
    cfg, layout, info, p = trainer.config, trainer.layout, trainer.info, trainer.params
    lines = [
        f"clustertrain: {trainer.hf_config.model_type} {p['total'] / 1e6:.2f}M params "  # the family built
        f"({p['trainable'] / 1e6:.2f}M trainable), "
        f"{info.world_size} rank(s) on {info.world_size // info.local_world_size} node(s) "
        f"via {info.launcher} on {trainer.device.type}, "
        f"{cfg.parallel.strategy} (dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard}, "
        f"tp={layout.tp}{trainer.runner.describe()})"
    ]
    capped = (f", train.micro_batch_size {cfg.train.micro_batch_size} capped at a rank's share"
              if cfg.train.micro_batch_size > layout.micro_batch and layout.pp == 1 else "")
    epochs = f" ({cfg.train.epochs:g} epochs of {trainer.epoch_steps} steps)" if trainer.epoch_steps else ""
    fused = "fused" if trainer.optimizer.param_groups[0].get("fused") else "foreach"
    lines.append(
        f"batch: {cfg.train.global_batch_size} seq x {cfg.data.seq_len} tokens = {trainer.tokens_per_step} tokens/step "
        f"({layout.dp} ranks x {cfg.train.global_batch_size // layout.dp} seq, micro {layout.micro_batch}{capped}); "
        f"{trainer.total_steps} steps = {trainer.total_steps * trainer.tokens_per_step / 1e6:.2f}M tokens{epochs}; "
        f"AdamW {fused}, {trainer.attention} attention, {trainer.loss_kind} loss"
    )
    lines += [*([trainer.layout_choice] if trainer.layout_choice else []), *trainer.kernel_notes, *trainer.plan.notes]
    lines.append(f"resuming from {resumed} at step {trainer.step}" if resumed
                 else f"starting fresh in {trainer.run_dir} (no checkpoint to resume)")
    if trainer.stop.reason:
        lines.append(f"{trainer.stop.reason} arrived while the run was starting: it saves and stops after step "
                     f"{trainer.step + 1}")
    return lines
