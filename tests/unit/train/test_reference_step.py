"""The 1-rank training step, and evaluation, against the same written by hand in plain PyTorch and transformers.

The trainer runs its real first two steps in this process (one rank, a process group of one). The reference is
a LlamaForCausalLM built here from TINY's numbers, holding the trainer's initial weights, which takes the same
batches in the same two micro batches (so the gradients' rounding is alike: Adam magnifies that of near-zero
gradients) through a hand-written cross entropy, global-norm clip, warmup learning rate and torch's AdamW. Two
steps, because AdamW's first update, g / (|g| + eps), hardly depends on the gradient's scale: a wrong clip
shows only once the moments mix steps clipped by different factors.

Three kinds of batches: pretraining rows of the standard library; SFT rows (loss on the completions only, then
padding), whose micro batches hold different numbers of loss tokens, so that only a mean over the step's tokens
agrees; and rows packed with short documents under `data.doc_masking`, which the reference runs one document
at a time (no attention across documents, positions from 0 in each).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY, write_docs_and_sft
from transformers import LlamaConfig, LlamaForCausalLM

from clustertrain.config.load import load_config
from clustertrain.data.pack import IGNORE_INDEX
from clustertrain.train.batches import to_device
from clustertrain.train.metrics import read_metrics
from clustertrain.train.trainer import Trainer

LR, WARMUP, CLIP, WEIGHT_DECAY, BETAS, EPS = 3e-3, 2, 0.5, 0.1, (0.9, 0.95), 1e-8
MICRO = 4  # TINY's train.micro_batch_size: two micro batches of the 8 sequences per step


def stage(trainer, loader):
    """The next batch of `loader` as the step gets it: on the device, with position ids where documents are packed."""
    return to_device(loader.next_batch(), trainer.place.device, trainer.config.data.packed_documents, trainer.model.attention)


DATA = {
    "pretrain": [],
    "sft": ["data.sources=[{path: DATA/sft.jsonl}]", "data.mode=sft", "data.eval_fraction=0.1"],
    "docs": ["data.sources=[{path: DATA/docs.jsonl}]", "data.doc_masking=true", "data.eval_fraction=0.1"],
}


def documents(positions: torch.Tensor) -> list[slice]:
    """A row's documents: a new one wherever its position ids restart."""
    starts = [j for j in range(len(positions)) if j == 0 or positions[j] != positions[j - 1] + 1]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], len(positions)])]


def reference_logits(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of the rows; with `positions`, each document forwarded alone, as if it were a row of its own."""
    if positions is None:
        return model(input_ids=input_ids).logits.float()
    return torch.stack([torch.cat([model(input_ids=ids[None, part]).logits[0] for part in documents(row)])
                        for ids, row in zip(input_ids, positions)]).float()


def reference_loss_sum(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross entropy over the labels that count, by hand."""
    logits = reference_logits(model, batch["input_ids"], batch.get("position_ids"))
    labels = batch["labels"]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * (labels != IGNORE_INDEX)).sum()


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
            part = reference_loss_sum(model, {k: v[half] for k, v in batch.items()}) / total
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


def build_trainer(run_dir, data: str, *overrides: str) -> Trainer:
    """The 1-rank trainer of TINY on `data` (a DATA key; its files written under `run_dir`), built and started."""
    write_docs_and_sft(run_dir)
    data_overrides = [o.replace("DATA", str(run_dir)) for o in DATA[data]]
    config = load_config(None, [*TINY, *data_overrides, f"train.run_dir={run_dir}", "train.sample_tokens=0",
                                *overrides])
    trainer = Trainer(config)
    trainer.build()
    trainer.start(None)
    return trainer


def reference_model(trainer: Trainer) -> LlamaForCausalLM:
    """A LlamaForCausalLM of TINY's numbers, built here, holding the trainer's weights."""
    # The local tokenizer's pad token is its end-of-text token: the model gets no pad id, so that token's
    # embedding learns (HF's padding_idx row would get no gradient).
    assert trainer.model.hf_config.pad_token_id is None
    reference = LlamaForCausalLM(LlamaConfig(
        vocab_size=trainer.model.hf_config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    ))
    reference.load_state_dict(trainer.model.runner.model.state_dict(), strict=True)
    return reference


def check_batch(data: str, batch: dict[str, torch.Tensor], eos: int) -> None:
    """What makes each kind of batch worth comparing: padding and uneven micro batches, or packed documents."""
    shifted = batch["labels"][:, :-1] != IGNORE_INDEX
    if "position_ids" in batch:  # a document's last label is its end-of-text, never the next document's first id
        shifted &= batch["position_ids"][:, 1:] == batch["position_ids"][:, :-1] + 1
    assert torch.equal(batch["labels"][:, :-1][shifted], batch["input_ids"][:, 1:][shifted]), "next tokens"
    if data == "sft":
        counts = [int((batch["labels"][half] != IGNORE_INDEX).sum()) for half in (slice(0, MICRO), slice(MICRO, None))]
        assert counts[0] != counts[1], "the micro batches must hold different numbers of loss tokens"
        assert (batch["labels"][:, -1] == IGNORE_INDEX).sum() >= len(batch["labels"]) // 2, "rows end in padding"
    if data == "docs":
        for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
            assert len(documents(positions)) >= 3, "several documents to a row"
            for j in range(1, len(ids)):  # position 0 right after each end-of-text, counting on everywhere else
                assert positions[j] == (0 if ids[j - 1] == eos else positions[j - 1] + 1), f"position {j}"


@pytest.mark.parametrize("data", list(DATA))
def test_one_rank_step_equals_a_hand_written_step(tmp_path, data):
    trainer = build_trainer(tmp_path, data, "train.steps=5", f"optim.lr={LR}", f"optim.warmup_steps={WARMUP}",
                            f"optim.grad_clip={CLIP}", f"optim.weight_decay={WEIGHT_DECAY}",
                            f"optim.betas=[{BETAS[0]}, {BETAS[1]}]", f"optim.eps={EPS}")
    try:
        loader = trainer.data.new_loader("train", trainer.place.mesh)  # the first batches, from a loader of its own
        batches = [stage(trainer, loader) for _ in range(2)]  # as the step gets them: position ids if used
        assert ("position_ids" in batches[0]) == (data != "pretrain")
        for batch in batches:
            check_batch(data, batch, trainer.data.tokenizer.eos_token_id)
        if data == "pretrain":
            assert trainer.model.hf_config.vocab_size == 512
        reference = reference_model(trainer)
        before = {name: p.detach().clone() for name, p in reference.named_parameters()}

        trainer.train_steps(2)
        trainer.logger.close()
        measured = reference_steps(reference, batches)
        logged = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r}
        trained = dict(trainer.model.runner.model.named_parameters())
    finally:
        trainer.close()

    assert all(norm > CLIP for _, norm in measured), "both steps must clip for the clip to be compared"
    for step, (loss, norm) in enumerate(measured, start=1):
        assert logged[step]["lr"] == pytest.approx(LR * step / WARMUP, rel=1e-12)
        assert logged[step]["loss"] == pytest.approx(loss, rel=1e-6), f"loss, step {step}"
        assert logged[step]["grad_norm"] == pytest.approx(norm, rel=1e-6), f"grad norm, step {step}"
    assert trained.keys() == before.keys()
    # Documents forwarded one at a time round unlike the masked rows: Adam's g / (|g| + eps) magnifies that in
    # the odd near-zero gradient (one weight of 8,192 off by 2e-6 after two steps); an update is lr = 3e-3.
    atol = 1e-6 if data == "pretrain" else 1e-5
    for name, p in reference.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not move"
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=1e-6, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("data", ["sft", "docs"])
def test_evaluation_is_the_mean_over_every_held_out_token(tmp_path, data):
    """`eval_loss` is the held-out batches' summed token loss over their loss-token count, computed here by hand
    (eval mode, each document alone): not a mean of per-batch or per-micro-batch means, which differ on SFT's
    padded rows."""
    trainer = build_trainer(tmp_path, data, "train.eval_batches=3")
    try:
        loader = trainer.data.new_loader("eval", trainer.place.mesh)
        batches = [stage(trainer, loader) for _ in range(3)]
        reference = reference_model(trainer).eval()
        trainer.evaluate()
        logged = trainer.summary.eval_loss
    finally:
        trainer.close()
    counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
    if data == "sft":
        assert len(set(counts)) == 3, f"the batches must hold different numbers of loss tokens: {counts}"
    with torch.no_grad():
        total = sum(reference_loss_sum(reference, batch).item() for batch in batches)
    assert logged == pytest.approx(total / sum(counts), rel=1e-6)
