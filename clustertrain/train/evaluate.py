"""Held-out loss: the mean over every loss token of `train.eval_batches` global batches, on every layout; and
lm-eval's scores of `train.eval_tasks` on the training model."""

from __future__ import annotations

import torch

from clustertrain.data.loader import StreamLoader
from clustertrain.distributed.collectives import all_reduce
from clustertrain.harness import run_tasks, summary
from clustertrain.parallel.apply import unwrap
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


def task_scores(runner: Runner, together: bool, tokenizer, tasks: list[str], limit: int | None,
                seed: int) -> dict[str, float]:
    """lm-eval's scores of `tasks` on the training model as {"eval_<task>_<metric>": value} (every rank calls).

    `together` (sharded weights): every rank runs every document in the same forwards through the training
    model; else each rank scores its share on its whole replica, and only rank 0 gets the scores ({} elsewhere).
    """
    model = runner.model if together else unwrap(runner.model)
    runner.train(False)
    try:
        results = run_tasks(model, tokenizer, tasks, limit=limit, seed=seed, together=together,
                            autocast_dtype=runner.autocast_dtype)
    finally:
        runner.train()
    return {f"eval_{row['task']}_{row['metric']}": row["value"] for row in summary(results)} if results else {}
