"""Layouts beyond data parallelism, with real processes: activation checkpointing and tensor parallelism."""

from __future__ import annotations

import pytest
from helpers import grad_norms, losses, train

pytestmark = pytest.mark.dist

DEEP = ("model.config={hidden_size: 128, intermediate_size: 256, num_hidden_layers: 4, num_attention_heads: 4, "
        "num_key_value_heads: 4, max_position_embeddings: 512}", "data.seq_len=128", "train.global_batch_size=4",
        "train.steps=3")


def test_activation_checkpointing_trains_like_no_checkpointing(tmp_path):
    """How much less it keeps is tests/unit/parallel/test_ac.py's; here a whole run under each mode agrees."""
    for name, mode in (("none", "none"), ("every_n", "every_n"), ("selective", "selective"), ("full", "full")):
        train(tmp_path / name, *DEEP, f"parallel.activation_checkpoint={mode}")
    for name in ("every_n", "selective", "full"):
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "none"), rel=1e-6)
        assert grad_norms(tmp_path / name) == pytest.approx(grad_norms(tmp_path / "none"), rel=1e-6)


OPT = ("model.arch=opt", "model.config={hidden_size: 64, ffn_dim: 128, num_hidden_layers: 2, num_attention_heads: 4, "
       "word_embed_proj_dim: 64, max_position_embeddings: 256, dropout: 0.0, attention_dropout: 0.0}")
LORA = ("lora.rank=4", "lora.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=0")


@pytest.mark.parametrize("overrides", [OPT, LORA], ids=["opt-own-plan", "lora"])
def test_tensor_parallel_matches_one_rank(tmp_path, overrides):
    """OPT under the plan clustertrain gives it, and LoRA adapters split with their linears, compute as on 1 rank."""
    train(tmp_path / "one", *overrides, "train.steps=4")
    train(tmp_path / "tp2", *overrides, "train.steps=4", "parallel.tp=2", nproc=2)
    assert losses(tmp_path / "tp2") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert grad_norms(tmp_path / "tp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-5)


def test_checkpoints_move_from_tp2_to_zero3_to_one_rank(tmp_path):
    common = ("train.steps=6", "checkpoint.every=2")
    train(tmp_path / "reference", *common)
    moved = tmp_path / "moved"
    train(moved, *common, "parallel.tp=2", "train.stop_after_steps=2", nproc=2)
    train(moved, *common, "parallel.strategy=zero3", "train.stop_after_steps=2", nproc=2)
    train(moved, *common)
    assert sorted(losses(moved)) == list(range(1, 7))
    assert losses(moved) == pytest.approx(losses(tmp_path / "reference"), rel=1e-5)
