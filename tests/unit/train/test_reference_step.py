"""The 1-rank training step against the same step written by hand in plain PyTorch and transformers.

The trainer runs its real first two steps in this process (one rank, a process group of one). The reference is
a LlamaForCausalLM built here from TINY's numbers, holding the trainer's initial weights, which takes the same
batches in the same two micro batches (so the gradients' rounding is alike: Adam magnifies that of near-zero
gradients) through a hand-written cross entropy, global-norm clip, warmup learning rate and torch's AdamW. Two
steps, because AdamW's first update, g / (|g| + eps), hardly depends on the gradient's scale: a wrong clip
shows only once the moments mix steps clipped by different factors.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY
from transformers import LlamaConfig, LlamaForCausalLM

from clustertrain.config.load import load_config
from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.train.metrics import read_jsonl
from clustertrain.train.trainer import Trainer

LR, WARMUP, CLIP, WEIGHT_DECAY, BETAS, EPS = 3e-3, 2, 0.5, 0.1, (0.9, 0.95), 1e-8
MICRO = 4  # TINY's train.micro_batch_size: two micro batches of the 8 sequences per step


def reference_steps(model: LlamaForCausalLM, batches: list[dict[str, torch.Tensor]]) -> list[tuple[float, float]]:
    """Steps by hand: mean next-token cross entropy, global norm, clip, AdamW at the warmup's lr; (loss, norm) each."""
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ], lr=LR, betas=BETAS, eps=EPS, foreach=False)
    measured = []
    for step, batch in enumerate(batches, start=1):
        total = (batch["labels"] != IGNORE_INDEX).sum()
        loss = 0.0
        for half in (slice(0, MICRO), slice(MICRO, None)):  # micro batches, as train.micro_batch_size asks
            logits = model(input_ids=batch["input_ids"][half]).logits.float()
            labels = batch["labels"][half]
            counted = labels != IGNORE_INDEX
            picked = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            part = -(picked * counted).sum() / total
            part.backward()
            loss += part.item()
        norm = math.sqrt(sum(p.grad.double().square().sum().item() for p in params))
        scale = min(1.0, CLIP / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
        for p in params:
            p.grad.mul_(scale)
        for group in optimizer.param_groups:
            group["lr"] = LR * min(1.0, step / WARMUP)  # linear warmup over WARMUP steps
        optimizer.step()
        optimizer.zero_grad()
        measured.append((loss, norm))
    return measured


def test_one_rank_step_equals_a_hand_written_step(tmp_path):
    config = load_config(None, [*TINY, f"train.run_dir={tmp_path}", "train.steps=5", f"optim.lr={LR}",
                                f"optim.warmup_steps={WARMUP}", f"optim.grad_clip={CLIP}",
                                f"optim.weight_decay={WEIGHT_DECAY}", f"optim.betas=[{BETAS[0]}, {BETAS[1]}]",
                                f"optim.eps={EPS}", "train.sample_tokens=0"])
    trainer = Trainer(config)
    try:
        trainer.build()
        trainer.start(None)
        loader = trainer._loader("train")  # the first batches, from a loader of its own
        batches = [loader.next_batch() for _ in range(2)]
        for batch in batches:
            shifted = batch["labels"][:, :-1] != IGNORE_INDEX
            assert torch.equal(batch["labels"][:, :-1][shifted], batch["input_ids"][:, 1:][shifted]), "next tokens"
        # The local tokenizer's pad token is its end-of-text token: the model gets no pad id, so that token's
        # embedding learns (HF's padding_idx row would get no gradient).
        assert (trainer.hf_config.vocab_size, trainer.hf_config.pad_token_id) == (512, None)
        reference = LlamaForCausalLM(LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        ))
        reference.load_state_dict(trainer.runner.model.state_dict(), strict=True)
        before = {name: p.detach().clone() for name, p in reference.named_parameters()}

        trainer.train_steps(2)
        trainer.logger.close()
        measured = reference_steps(reference, batches)
        logged = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r}
        trained = dict(trainer.runner.model.named_parameters())
    finally:
        trainer.close()

    assert all(norm > CLIP for _, norm in measured), "both steps must clip for the clip to be compared"
    for step, (loss, norm) in enumerate(measured, start=1):
        assert logged[step]["lr"] == pytest.approx(LR * step / WARMUP, rel=1e-12)
        assert logged[step]["loss"] == pytest.approx(loss, rel=1e-6), f"loss, step {step}"
        assert logged[step]["grad_norm"] == pytest.approx(norm, rel=1e-6), f"grad norm, step {step}"
    assert trained.keys() == before.keys()
    for name, p in reference.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not move"
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=1e-6, atol=1e-6, msg=name)
