"""Held-out loss: the mean over every loss token of `train.eval_batches` global batches, on every layout."""

from __future__ import annotations

import torch

from clustertrain.data.loader import StreamLoader
from clustertrain.distributed.collectives import all_reduce
from clustertrain.parallel.runner import Runner
from clustertrain.train.batches import to_device
from clustertrain.train.step import loss_tokens, out_of_memory_named


@torch.no_grad()
def evaluate(runner: Runner, loader: StreamLoader, batches: int, microbatches: int, dp_group, device: torch.device,
             packed_documents: bool, attention: str) -> float:
    """The mean loss per loss token over `batches` held-out global batches (every rank calls, with its share).

    Each batch runs in training's `microbatches`, so its activations fit where training's fit.
    """
    runner.train(False)
    totals = torch.zeros(2, device=device)
    for _ in range(batches):
        batch = to_device(loader.next_batch(), device, packed_documents, attention)
        rows, seq_len = batch["input_ids"].shape
        with out_of_memory_named(rows // microbatches, seq_len):
            totals[0] += runner.eval_loss_sum(batch)
        totals[1] += loss_tokens(batch["labels"])
    totals = all_reduce(totals, group=dp_group)
    runner.train()
    return (totals[0] / totals[1]).item()
