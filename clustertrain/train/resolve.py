"""A run's config resolved once, before the run starts, and only read from then on.

    run = resolve_run(config, world_size=8, local_world_size=4, device_type="cuda")  # no process group needed
    run.config.train.global_batch_size, run.layout.dp_shard, run.config.model.path     # every derived value
    clustertrain config show CONFIG --world 8                                        # the same, printed

Derived here, in a copy (configs are frozen: RunConfig.updated): the layout (its global batch, and the
pipeline microbatches, written into the config so that the run's config.yaml holds them, which a resume needs), the parameter dtype on the device, the model path
made absolute (adapters exported from the run load from anywhere), the tokenizer of a fine-tuned snapshot.
Only the step count of `train.epochs` needs the data: `resolve_epochs` adds it once the data is counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from clustertrain.config.checks import Layout, apply_layout, resolve_layout
from clustertrain.config.schema import RunConfig
from clustertrain.data.plan import DataPlan
from clustertrain.distributed.collectives import reduce_values
from clustertrain.files import write_atomic
from clustertrain.model.build import snapshot_dir
from clustertrain.model.spec import model_shape
from clustertrain.parallel.apply import resolve_param_dtype
from clustertrain.train.trackers import check_trackers


@dataclass(frozen=True)
class ResolvedRun:
    """The resolved config of a run on a world, its layout, and the local snapshot it starts from (or None)."""

    config: RunConfig
    layout: Layout
    snapshot: Path | None
    choice: str | None = None  # parallel.strategy auto: what was chosen and why, one line


def resolve_run(config: RunConfig, world_size: int, local_world_size: int, device_type: str | None) -> ResolvedRun:
    """Check `config` on `world_size` ranks and fill in everything derived; `config` itself is not changed.
    `device_type` ("cuda" or "cpu") resolves parallel.param_dtype; None leaves it as configured (a login node
    that does not know the compute nodes' GPUs).

    Raises:
        ConfigError: every problem of the config on this world, at once; or an enabled tracker's missing package.
    """
    check_trackers(config.metrics)
    choice = None
    if config.parallel.strategy == "auto":
        from clustertrain.plan.auto import choose_layout

        config, choice = choose_layout(config, world_size, local_world_size, device_type)
    layout = resolve_layout(config, world_size, local_world_size, model_shape(config.model, config.data.vocab_size))
    resolved = apply_layout(config, layout)
    if device_type is not None:
        resolved = resolved.updated(parallel={"param_dtype": resolve_param_dtype(config.parallel.param_dtype,
                                                                                 device_type)})
    if config.model.path:
        resolved = resolved.updated(model={"path": str(Path(config.model.path).resolve())})
    snapshot = snapshot_dir(resolved.model)
    if snapshot is not None and not config.data.tokenizer:
        resolved = resolved.updated(data={"tokenizer": str(snapshot)})  # fine-tuning: the model's own tokenizer
    return ResolvedRun(resolved, layout, snapshot, choice)


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
