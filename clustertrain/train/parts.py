"""The typed parts a trainer conducts, each built by its owner in the fixed order: place, data, model,
optimization (clustertrain.train.trainer.Trainer.build).

    place = Place(info, layout, device, build_mesh(layout, device.type), rank=dist.get_rank())
    data = build_data(config, place)                # tokenizer, sources, this rank's loader (every rank calls)
    model = lay_out_model(config, place, build_meta_model(config, place, data.tokenizer), snapshot)  # a runner
    optim = build_optimization(config, model, place.device)
    checkpoints = build_checkpoints(config, files, total_steps, place, data, model, optim, snapshot, resume_point, log)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from clustertrain.checkpoint.manager import CheckpointManager, ResumePoint, StandAlone, Tracked
from clustertrain.config.layout import Layout
from clustertrain.config.load import dump_config
from clustertrain.config.schema import RunConfig
from clustertrain.data.audit import AuditLog
from clustertrain.data.loader import StreamLoader
from clustertrain.data.plan import DataPlan
from clustertrain.data.tokenize import cache_root, load_tokenizer
from clustertrain.distributed.collectives import reduce_values
from clustertrain.distributed.env import RankInfo
from clustertrain.distributed.mesh import Mesh
from clustertrain.distributed.rank0 import rank0_first
from clustertrain.harness import check_tasks
from clustertrain.model.build import BuiltModel, block_classes, build_model
from clustertrain.model.estimate import check_training_memory, count_params, model_flops_per_token
from clustertrain.model.loss import TokenLoss
from clustertrain.model.weights import materialize
from clustertrain.parallel.apply import DTYPES, parallelize
from clustertrain.parallel.runner import Runner
from clustertrain.run_dir import RunDir
from clustertrain.train.batches import TrainBatches
from clustertrain.train.memory import PeakMemory, resident_bytes
from clustertrain.train.optim import Optimizers, build_optimizer


@dataclass(frozen=True)
class Place:
    """Where this rank runs: the launcher's facts, the layout, its one device and the mesh."""

    info: RankInfo
    layout: Layout
    device: torch.device
    mesh: Mesh
    rank: int  # in the process group

    @property
    def rank0(self) -> bool:
        return self.rank == 0


@dataclass
class DataParts:
    """The run's tokenizer, its data sources (train and held-out ranges) and this rank's training loader."""

    tokenizer: Any  # transformers tokenizer, or None for token-id data
    plan: DataPlan
    loader: StreamLoader
    epoch_steps: int | None = None  # with train.epochs: the steps of one pass over the data

    def new_loader(self, split: str, mesh: Mesh, workers: int = 0) -> StreamLoader:
        """A loader of `split` ("train" or "eval") for this rank, from the start of its range."""
        return _loader(self.plan, split, mesh, workers)


@dataclass
class ModelParts:
    """This rank's laid-out model and what the run says and counts of it."""

    runner: Runner  # the model parts (one, or this rank's pipeline stages) and how a step runs through them
    hf_config: Any  # transformers.PretrainedConfig
    attention: str
    loss_kind: str  # "full", "chunked", ...: how the loss head computes
    notes: list[str] = field(default_factory=list)  # the kernels' start lines
    params: dict[str, int] = field(default_factory=dict)  # total and trainable
    flops_per_token: float = 0.0
    resident_before: int = 0  # this CPU rank's resident bytes before the model (the plan's baseline)
    load_mem_gb: float = 0.0  # the largest rank's peak memory once the weights are in


@dataclass
class Optimization:
    """The optimizer of every model part and float16's loss scaler."""

    optimizer: Optimizers
    scaler: ShardedGradScaler | None


def build_data(cfg: RunConfig, place: Place) -> DataParts:
    """The tokenizer (trained and cached on rank 0 first), the data sources indexed, and this rank's loader.
    A `train.eval_tasks` task that cannot run fails here, not at step N."""
    tokenizer = rank0_first("preparing the tokenizer", lambda: load_tokenizer(cfg.data))
    if cfg.train.eval_tasks and tokenizer is not None:
        rank0_first("checking train.eval_tasks", lambda: place.rank0 and check_tasks(cfg.train.eval_tasks, tokenizer))
    plan = rank0_first("indexing the data sources", lambda: DataPlan(
        cfg.data, tokenizer, cfg.train.global_batch_size, cfg.data_seed, cache_root(cfg.data)
    ))  # rank 0 first: it writes the source indexes the others then read
    return DataParts(tokenizer, plan, _loader(plan, "train", place.mesh, cfg.data.num_workers))


def _loader(plan: DataPlan, split: str, mesh: Mesh, workers: int) -> StreamLoader:
    split_plan, part = plan.for_split(split)
    return StreamLoader(split_plan, mesh.dp_rank, mesh.dp_size, workers, part)


def build_meta_model(cfg: RunConfig, place: Place, tokenizer: Any) -> BuiltModel:
    """The run's model on the meta device, with its kernels and loss head; refused if it cannot fit."""
    layout, device, dtype = place.layout, place.device, DTYPES[cfg.parallel.param_dtype]
    built = build_model(cfg.model, cfg.lora, tokenizer, cfg.data.vocab_size, param_dtype=dtype,
                        device=device, loss=cfg.train.loss, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                        compile=cfg.parallel.compile, tp=layout.degree("tp"), pipeline=layout.degree("pp") > 1,
                        packed_documents=cfg.data.packed_documents)
    check_training_memory(built.model, device, rows=layout.micro_batch, seq_len=cfg.data.seq_len,
                          full_logits=built.loss == "full", chunk_tokens=cfg.train.loss_chunk_tokens,
                          activation_bytes=dtype.itemsize, ranks=layout.world_size, stages=layout.degree("pp"),
                          tp=layout.degree("tp"))
    return built


def lay_out_model(cfg: RunConfig, place: Place, built: BuiltModel, snapshot: Path | None) -> ModelParts:
    """The meta model laid out by parallelize, its weights initialised or streamed from `snapshot` into this
    rank's shards."""
    device = place.device
    params, flops = count_params(built.model), model_flops_per_token(built.model, cfg.data.seq_len)
    resident_before = resident_bytes() if device.type == "cpu" else 0  # what the model adds to
    runner = parallelize(
        built.model, cfg.parallel, place.mesh, device, block_classes(built.model),
        materialize=lambda m: materialize(m, device, cfg.train.seed, snapshot),
        loss=TokenLoss(), microbatches=place.layout.grad_accum,
    )
    load_mem_gb, = reduce_values([PeakMemory(device).read_and_reset()["mem_gb"]], op="max")
    return ModelParts(runner, built.hf_config, built.attention, built.loss, built.notes, params, flops,
                      resident_before, load_mem_gb)


def build_optimization(cfg: RunConfig, model: ModelParts, device: torch.device) -> Optimization:
    """One AdamW per model part, built after sharding, and float16's loss scaler."""
    float16 = cfg.parallel.param_dtype == "float16"
    optimizer = build_optimizer(model.runner.parts, cfg.optim, loss_scaling=float16)
    scaler = ShardedGradScaler(device.type, init_scale=cfg.parallel.loss_scale) if float16 else None
    return Optimization(optimizer, scaler)


def build_checkpoints(cfg: RunConfig, files: RunDir, total_steps: int, place: Place, data: DataParts,
                      model: ModelParts, optim: Optimization, snapshot: Path | None, resume_point: ResumePoint,
                      log: Callable[[str], None]) -> CheckpointManager:
    """The run's checkpoint manager, tracking the model parts, optimizer, data position and loss scaler; its
    folders stand alone (the resolved config, and a snapshot's HF config and tokenizer)."""
    extras = StandAlone(dump_config(cfg), model.hf_config, data.tokenizer, snapshot,
                        adapters_only=cfg.lora.enabled and snapshot is not None, strategy=cfg.parallel.strategy)
    tracked = Tracked(model.runner.parts, optim.optimizer, data.loader, optim.scaler)
    return CheckpointManager(files, cfg.checkpoint, total_steps, place.device, extras, tracked, resume_point, log=log)


def build_batches(cfg: RunConfig, files: RunDir, place: Place, data: DataParts, model: ModelParts) -> TrainBatches:
    """This rank's training batches on its device (each sample's origin in `data.audit`'s log when asked)."""
    audit = AuditLog(files.samples, data.plan.labels, place.mesh.dp_rank) if cfg.data.audit else None
    return TrainBatches(data.loader, data.plan.labels, place.device, cfg.data.packed_documents, model.attention,
                        audit)
