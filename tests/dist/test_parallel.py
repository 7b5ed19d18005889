"""Layouts beyond data parallelism, with real processes: activation checkpointing."""

from __future__ import annotations

import pytest
from helpers import losses, train

from clustertrain.train.metrics import read_jsonl

pytestmark = pytest.mark.dist

# Activations outweigh weights here: 8 blocks of width 128 at 512 tokens, 8 sequences per micro-batch.
DEEP = ("model.config={hidden_size: 128, intermediate_size: 256, num_hidden_layers: 8, num_attention_heads: 4, "
        "num_key_value_heads: 4, max_position_embeddings: 512}", "data.seq_len=512", "train.global_batch_size=8",
        "train.micro_batch_size=8", "train.steps=3")


def peak_gb(run_dir) -> float:
    return max(r["mem_gb"] for r in read_jsonl(run_dir / "metrics.jsonl") if "mem_gb" in r)


def test_activation_checkpointing_lowers_peak_memory_at_equal_loss(tmp_path):
    runs = {"none": (), "selective": ("parallel.activation_checkpoint=selective",),
            "full": ("parallel.activation_checkpoint=full",)}
    for name, overrides in runs.items():
        train(tmp_path / name, *DEEP, *overrides)
    peak = {name: peak_gb(tmp_path / name) for name in runs}
    print("peak RSS (GB):", {name: f"{gb:.3f}" for name, gb in peak.items()})
    assert peak["full"] < peak["selective"] < peak["none"], peak
    for name in ("selective", "full"):
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "none"), rel=1e-6)
