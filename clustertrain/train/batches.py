"""Batches on this rank's device, and what the training batches tell: the realized mixture and the audit."""

from __future__ import annotations

from collections import Counter

import torch

from clustertrain.data.audit import AuditLog
from clustertrain.data.loader import StreamLoader
from clustertrain.distributed.collectives import reduce_values
from clustertrain.model.attention import use_documents


def to_device(batch: dict, device: torch.device, packed_documents: bool, attention: str) -> dict[str, torch.Tensor]:
    """A loader batch on `device` (copied from pinned memory on a GPU: the host does not wait); position ids only
    when packed documents must not see each other, and then flash-attn gets the documents' lengths as the
    loader found them (no read from the GPU)."""
    keys = ["input_ids", "labels", *(["position_ids"] if packed_documents else [])]
    moved = {k: batch[k].to(device, non_blocking=True) for k in keys}
    if "position_ids" in moved and attention == "flash_attention_2":
        use_documents(moved["position_ids"], batch["cu_seq_lens"], batch["cu_seq_lens"].to(device, non_blocking=True))
    return moved


class TrainBatches:
    """The training loader's batches on the device, counted by source (the realized mixture) and recorded by
    the audit (`data.audit`) under the step they train."""

    def __init__(self, loader: StreamLoader, labels: list[str], device: torch.device, packed_documents: bool,
                 attention: str, audit: AuditLog | None):
        self.loader, self.labels, self.audit = loader, labels, audit
        self.device, self.packed_documents, self.attention = device, packed_documents, attention
        self.mixture: Counter = Counter()

    def next(self, step: int) -> dict[str, torch.Tensor]:
        """The batch of optimizer step `step`, on the device."""
        batch = self.loader.next_batch()
        self.mixture.update(batch["tokens_by_source"])
        if self.audit:
            self.audit.record(step, batch["origins"])
        return to_device(batch, self.device, self.packed_documents, self.attention)

    def metrics(self, dp_group) -> dict[str, float]:
        """Realized mixture proportions (share of tokens per source so far) and skipped bad records, global."""
        counts = reduce_values([self.mixture[label] for label in self.labels] + [sum(self.loader.skipped.values())],
                               group=dp_group)
        total = sum(counts[:-1]) or 1.0
        metrics = ({f"mix/{label}": counts[i] / total for i, label in enumerate(self.labels)}
                   if len(self.labels) > 1 else {})
        if counts[-1] > 0:
            metrics["data_skipped"] = int(counts[-1])
        return metrics
