"""Layouts beyond data parallelism, with real processes: activation checkpointing and tensor parallelism, with
sequence parallelism (on by default at tp > 1) and without."""

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
QWEN2 = ("model.arch=qwen2", "model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256}")
TP2 = ("parallel.tp=2",)
TP4 = ("parallel.tp=4",)
HYBRID = ("parallel.tp=2", "parallel.strategy=hybrid_zero3", "parallel.hybrid_shard_size=1")  # 4 ranks: 2 replicas
KV4 = ("model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
       "num_key_value_heads: 4, max_position_embeddings: 256}",)  # key/value heads tp 4 divides


CHUNKED = ("train.loss=chunked", "train.loss_chunk_tokens=100")


@pytest.mark.parametrize("overrides, layout", [((*OPT, *LORA, *CHUNKED), TP2), ((*QWEN2, *CHUNKED), TP2),
                                               (("parallel.sequence_parallel=false",), TP2), (LORA, HYBRID),
                                               (KV4, TP4)],
                         ids=["opt-lora", "qwen2", "no-sequence-parallel", "lora-hybrid-zero3", "tp4"])
def test_tensor_parallel_matches_one_rank(tmp_path, overrides, layout):
    """With the sequence split over the tp ranks and the head and embedding split by vocabulary rows (the chunked
    loss over the shards): OPT under the plan clustertrain gives it, its tied head and LoRA adapters split with
    their linears; Qwen2; Llama with LoRA under hybrid_zero3 (2 replicas of tp 2), at tp 4, and without sequence
    parallelism. The losses and gradient norms of one rank, and the same end-of-run sample from gathered logits."""
    ends = {}
    for name, split in (("one", ()), ("tp", layout)):
        result = train(tmp_path / name, *overrides, "train.steps=4", *split,
                       nproc=None if not split else 2 if split == TP2 else 4)
        ends[name] = [line for line in result.stdout.splitlines() if line.lstrip().startswith("sample ")]
    assert losses(tmp_path / "tp") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert grad_norms(tmp_path / "tp") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-5)
    assert len(ends["one"]) == 1 and ends["tp"] == ends["one"]


def test_sequence_parallel_dropout_resumes_exactly(tmp_path):
    """OPT's dropout on the residual stream draws each rank's slice from that rank's random state (not one rank's
    masks: DTensor's RNG tracker does not run on CPU meshes), which a checkpoint restores: a run stopped and resumed
    draws what an uninterrupted one draws."""
    dropout = (*OPT[:-1], OPT[-1].replace("dropout: 0.0, attention_dropout: 0.0", "dropout: 0.2, attention_dropout: "
                                          "0.2"), "train.steps=4", "checkpoint.every=2", "parallel.tp=2")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(whole, *dropout, nproc=2)
    train(resumed, *dropout, "train.stop_after_steps=2", nproc=2)
    assert "at step 2" in train(resumed, *dropout, nproc=2).stdout
    assert losses(resumed) == losses(whole) and sorted(losses(whole)) == [1, 2, 3, 4]


def test_checkpoints_move_from_tp2_to_zero3_to_one_rank(tmp_path):
    common = ("train.steps=6", "checkpoint.every=2")
    train(tmp_path / "reference", *common)
    moved = tmp_path / "moved"
    train(moved, *common, "parallel.tp=2", "train.stop_after_steps=2", nproc=2)
    train(moved, *common, "parallel.strategy=zero3", "train.stop_after_steps=2", nproc=2)
    train(moved, *common)
    assert sorted(losses(moved)) == list(range(1, 7))
    assert losses(moved) == pytest.approx(losses(tmp_path / "reference"), rel=1e-5)
