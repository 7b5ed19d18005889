"""Runs with dropout on resume exactly: each rank's random state is saved and restored, so a run stopped and
resumed draws the same dropout masks as one that never stopped (real 2-rank runs)."""

from __future__ import annotations

import pytest
from helpers import losses, train

pytestmark = pytest.mark.dist

STEPS = ["train.steps=6", "checkpoint.every=3", "parallel.strategy=zero3"]
DROPOUT = {
    # dropout on the adapters' input, over a model built from scratch
    "lora": ["lora.rank=4", "lora.alpha=8", "lora.dropout=0.3", "optim.lr=1e-2", "optim.warmup_steps=0"],
    # GPT-2's embedding, residual and attention dropout, set through model.config
    "gpt2": ["model.arch=gpt2", ("model.config={n_embd: 64, n_layer: 2, n_head: 4, n_positions: 256, "
                                 "embd_pdrop: 0.3, resid_pdrop: 0.3, attn_pdrop: 0.3}")],
}


@pytest.mark.parametrize("model", list(DROPOUT))
def test_resume_with_dropout_matches_uninterrupted(tmp_path, model):
    overrides = [*STEPS, *DROPOUT[model]]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(whole, *overrides, nproc=2)
    train(resumed, *overrides, "train.stop_after_steps=3", nproc=2)
    second = train(resumed, *overrides, nproc=2)
    assert "at step 3" in second.stdout
    assert losses(resumed) == losses(whole)  # exactly: the same masks, step for step
    assert sorted(losses(resumed)) == list(range(1, 7))
