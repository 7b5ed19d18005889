"""The steps of `train.epochs`, the one settled value that needs the data: counted once the data is indexed (every
rank calls), and kept in the run directory for the run's later starts.

    config, per_epoch = resolve_epochs(run.config, plan, loader.stream_ids, tokenizer, files.epoch_count, rank0)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from clustertrain.config.schema import RunConfig
from clustertrain.data.plan import DataPlan
from clustertrain.distributed.collectives import reduce_values
from clustertrain.files import write_atomic


def resolve_epochs(config: RunConfig, plan: DataPlan, stream_ids: list[int], tokenizer, saved: Path, rank0: bool
                   ) -> tuple[RunConfig, int | None]:
    """With train.epochs: `config` with train.steps set to that many passes over the training data, and the steps
    of one (count_epoch; every rank calls). Without: `config` as it is, and None."""
    if config.train.epochs is None:
        return config, None
    per_epoch = count_epoch(config.train.epochs, plan, stream_ids, tokenizer, saved, rank0)
    return config.updated(train={"steps": max(1, math.floor(config.train.epochs * per_epoch))}), per_epoch


def count_epoch(epochs: float, plan: DataPlan, stream_ids: list[int], tokenizer, saved: Path, rank0: bool) -> int:
    """The steps of one pass over the training data: the fewest any data-parallel rank's streams give (every
    rank calls; `stream_ids` are this rank's).

    Counting tokenizes the data once, so the count is kept in `saved` for the run's later starts (a requeue),
    as long as the data, its streams and the tokenizer are the same."""
    key = [plan.fingerprint(), plan.num_streams, str(tokenizer.name_or_path), len(tokenizer)]
    per_epoch = _saved_count(saved, key)
    if per_epoch is None:
        if rank0:
            print(f"train.epochs = {epochs:g}: counting the sequences of one pass over the data", flush=True)
        per_epoch = int(reduce_values([plan.sequences_per_epoch(stream_ids)], op="min")[0])
        if rank0:
            write_atomic(saved, json.dumps({"key": key, "sequences": per_epoch}))
    return per_epoch


def _saved_count(path: Path, key: list) -> int | None:
    """The sequences of one epoch that an earlier start of the run counted under `key`, or None."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved.get("sequences") if isinstance(saved, dict) and saved.get("key") == key else None
