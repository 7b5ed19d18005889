"""The layout: a config against a world size, before any process group starts, in the vocabulary of parallelism.

    problems = check_world(config, world_size=40, local_world_size=8, shape=model_shape(hf_config))  # [] if it fits
    layout = resolve_layout(config, 40, 8, shape)   # or one ConfigError listing them all
    layout.degree("tp"), layout.dp                  # a dimension's degree; the data-parallel ranks
    clustertrain config check configs/frontier-llama3-8b.yaml --nodes 64         # the same, on a login node

The arithmetic a run lays itself out with lives here, once: the dimensions of parallelism (DIMS) and their
degrees, the data-parallel wrapper (distributed/mesh.py builds its mesh from the Layout, parallel/apply.py
wraps by it), the rows of a step on each rank, and its micro-batches or pipeline microbatches. Model facts come
in as a ModelShape, read from the HF config alone (no weights). A new dimension is one entry of DIMS (with its
config key, when it has one, named like it) plus its step in parallel/apply.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from clustertrain.config.schema import ParallelConfig, RunConfig, TrainConfig
from clustertrain.errors import ConfigError

# The dimensions of parallelism, outermost first: the world is laid out in this order, tp innermost, so that
# tensor-parallel peers are neighbouring ranks (the same node, when tp fits in one). cp (context parallelism)
# has no config key yet: its degree is 1.
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DATA_PARALLEL = ("dp_replicate", "dp_shard")  # the dimensions whose ranks read different rows
SHOWN = ("tp", "pp")  # in every describe() line, even at 1; other dimensions beyond data parallelism when used
MAX_STREAMS_PER_RANK = 1 << 16  # rows of a step on one rank: each is a data stream with its own reader
INTERLEAVED = ("interleaved_1f1b",)


@dataclass(frozen=True)
class ModelShape:
    """What a layout needs of the model (clustertrain.parallel.tp.model_shape reads it from an HF config).

    Attributes:
        tp_problem, pp_problem: why the architecture cannot be split by parallel.tp or parallel.pp, or None.
        sp_problem: why it cannot run parallel.sequence_parallel (its family declares no norms), or None.
    """

    model_type: str
    heads: int | None
    kv_heads: int | None
    layers: int | None
    tp_problem: str | None = None
    pp_problem: str | None = None
    sp_problem: str | None = None


@dataclass(frozen=True)
class Layout:
    """How a config runs on `world_size` ranks.

    Attributes:
        degrees: the ranks along each dimension, every one of DIMS in its order; their product is `world_size`.
    """

    world_size: int
    degrees: dict[str, int]
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per forward on one rank (per pipeline microbatch under pp)
    grad_accum: int  # forwards per rank per step: micro-batches, or pipeline microbatches under pp
    wrapper: Literal["fsdp", "ddp"] | None  # what wraps each model part for data parallelism (wrapper_for)
    sequence_parallel: bool = False  # parallel.sequence_parallel settled (sequence_parallel_for)

    def __post_init__(self) -> None:
        assert tuple(self.degrees) == DIMS, f"a layout has a degree for each of {DIMS}, in order: {self.degrees}"
        assert math.prod(self.degrees.values()) == self.world_size, (self.degrees, self.world_size)

    def degree(self, dim: str) -> int:
        """The ranks along dimension `dim` (one of DIMS)."""
        return self.degrees[dim]

    # The config's degrees by name, read by the plan, the trainer and its start-up lines; parallel/ and the mesh
    # read degree(dim), and a new dimension needs no property.
    @property
    def dp(self) -> int:
        """The data-parallel ranks: those that read different rows."""
        return math.prod(self.degrees[dim] for dim in DATA_PARALLEL)

    def describe(self, seq_len: int) -> str:
        """One line: the degrees, the batch arithmetic (micro × accumulation × dp ranks = global batch), and
        whether the sequence is split over tp."""
        accum = "pipeline microbatches" if self.degree("pp") > 1 else "grad accum"
        data = " × ".join(f"{dim} {self.degrees[dim]}" for dim in DATA_PARALLEL)
        others = "".join(f", {dim} {n}" for dim, n in reversed(self.degrees.items())
                         if dim not in DATA_PARALLEL and (n > 1 or dim in SHOWN))
        return (f"dp {self.dp} ({data}){others}; micro batch {self.micro_batch} × {accum} {self.grad_accum} × "
                f"{self.dp} dp ranks = global batch {self.global_batch} sequences × {seq_len} tokens = "
                f"{self.global_batch * seq_len:,} tokens/step"
                + ("; sequence parallel over tp" if self.sequence_parallel else ""))

    def to_json(self) -> dict:
        """The layout as one flat record: the world size, each degree by its dimension, the batch, the wrapper."""
        return {"world_size": self.world_size, **self.degrees, "global_batch": self.global_batch,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "wrapper": self.wrapper,
                "sequence_parallel": self.sequence_parallel}


def check_world(config: RunConfig, world_size: int, local_world_size: int | None = None,
                shape: ModelShape | None = None) -> list[str]:
    """Every problem of running `config` on `world_size` ranks (`local_world_size` per node), one line each,
    naming the key and sizes that would fit; [] when it fits. Model checks need `shape`."""
    return _resolve(config, world_size, local_world_size or world_size, shape)[1]


def resolve_layout(config: RunConfig, world_size: int, local_world_size: int | None = None,
                   shape: ModelShape | None = None) -> Layout:
    """The layout of `config` on `world_size` ranks.

    Raises:
        ConfigError: every problem check_world finds, one per line.
    """
    layout, problems = _resolve(config, world_size, local_world_size or world_size, shape)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else f"{len(problems)} problems with this config on "
                          f"{world_size} ranks:\n" + "\n".join(f"  {p}" for p in problems))
    assert layout is not None
    return layout


def _resolve(config: RunConfig, world: int, local: int, shape: ModelShape | None) -> tuple[Layout | None, list[str]]:
    problems: list[str] = []
    degrees, more = degree_problems(config.parallel, world, local)
    problems += more
    if shape is not None:
        problems += model_problems(config.parallel, shape)
    sequence_parallel, more = sequence_parallel_for(config, shape)
    problems += more
    if config.train.steps is None and config.train.tokens is None and config.train.epochs is None:
        problems.append("train: set train.steps, train.tokens or train.epochs")
    if degrees is None:
        return None, problems
    dp = math.prod(degrees[dim] for dim in DATA_PARALLEL)
    batch, more = batch_layout(config.train, config.parallel, dp)
    problems += more
    if batch is None or problems:
        return None, problems
    wrapper = wrapper_for(config.parallel.strategy, degrees["pp"], dp, degrees["tp"])
    return Layout(world, degrees, *batch, wrapper=wrapper, sequence_parallel=sequence_parallel), problems


# ---- degrees ---------------------------------------------------------------------------------------------
def degree_problems(parallel: ParallelConfig, world: int, local_world: int
                    ) -> tuple[dict[str, int] | None, list[str]]:
    """The degree of each dimension (DIMS, in order) or None, and the problems. Set degrees are taken as given;
    unset data-parallel ones default from the strategy; a dimension with no config key yet is 1."""
    keyed = [dim for dim in DIMS if dim in ParallelConfig.model_fields]  # the dimensions a config key sets
    fixed = {dim: getattr(parallel, dim) if dim in keyed else 1 for dim in DIMS if dim not in DATA_PARALLEL}
    named = [dim for dim in fixed if dim in keyed]  # of those beyond data parallelism
    model_parallel = math.prod(fixed.values())
    if world % model_parallel:
        keys = " × ".join(f"parallel.{dim}" for dim in named)
        values = " × ".join(str(fixed[dim]) for dim in named)
        return None, [f"{keys} = {values} does not divide the {world} ranks; use {' × '.join(named)} in "
                      f"{divisors(world)}, or a multiple of {model_parallel} ranks"]
    dp = world // model_parallel
    replicate, shard = parallel.dp_replicate, parallel.dp_shard
    if replicate is None and shard is None:
        if parallel.strategy == "ddp":
            replicate, shard = dp, 1
        elif not parallel.strategy.startswith("hybrid"):
            replicate, shard = 1, dp
        else:
            shard = parallel.hybrid_shard_size or max(1, local_world // model_parallel)
            if dp % shard:
                return None, [f"parallel.hybrid_shard_size = {shard} does not divide the {dp} data-parallel ranks; "
                              f"use one of {divisors(dp)}"]
            replicate = dp // shard
    elif replicate is None:
        replicate = dp // shard if dp % shard == 0 else 0
    elif shard is None:
        shard = dp // replicate if dp % replicate == 0 else 0
    if replicate * shard != dp:
        given = " × ".join(f"{dim} {getattr(parallel, dim) or '?'}" for dim in keyed)
        with_ = " and ".join(f"{dim} {fixed[dim]}" for dim in named)
        return None, [f"parallel: {given} must equal the {world} ranks; with {with_}, dp_replicate × dp_shard must "
                      f"be {dp} (each one of {divisors(dp)})"]
    problems = [f"parallel.dp_shard = {shard} shards, but parallel.strategy is ddp; use zero2, zero3 or a hybrid "
                "strategy, or dp_shard 1"] if parallel.strategy == "ddp" and shard > 1 else []
    data = {"dp_replicate": replicate, "dp_shard": shard}
    return {dim: data[dim] if dim in DATA_PARALLEL else fixed[dim] for dim in DIMS}, problems


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def wrapper_for(strategy: str, pp: int, dp: int, tp: int) -> Literal["fsdp", "ddp"] | None:
    """fsdp for the zero strategies and any tp-split model, ddp for replicas of a whole model, None for one
    data-parallel rank.

    Under tp, "ddp" is FSDP2 over (dp_replicate, dp_shard=1), which replicates: it also turns every
    parameter into a DTensor, which the optimizer needs when some already are. Under pp it is the same,
    because pipelining drives FSDP2's gradient sync across microbatches itself. With one data-parallel rank
    and no tp there is nothing to shard or sync, so no wrapper costs its hooks and copies (as torchtitan
    does on one GPU): autocast applies the compute dtype.
    """
    if tp > 1 or (pp > 1 and dp > 1):
        return "fsdp"
    if dp == 1:
        return None
    return "ddp" if strategy == "ddp" else "fsdp"


# ---- the model ---------------------------------------------------------------------------------------------
def model_problems(parallel: ParallelConfig, shape: ModelShape) -> list[str]:
    """Heads against parallel.tp, decoder layers against the pipeline's stages, and whether the family splits."""
    problems = []
    tp = parallel.tp
    if tp > 1 and shape.tp_problem:
        problems.append(shape.tp_problem)
    elif tp > 1:
        kv_heads = shape.kv_heads or shape.heads
        for what, count in (("attention heads", shape.heads), ("key/value heads", kv_heads)):
            if count and count % tp:
                problems.append(f"parallel.tp = {tp} does not divide the model's {count} {what}; use one of "
                                f"{divisors(count)}")
                break  # key/value heads divide the heads: a tp that fails the heads fails them too
    if parallel.pp > 1 and shape.pp_problem:
        problems.append(shape.pp_problem)
    elif parallel.pp > 1 and shape.layers:
        per_rank = parallel.pp_stages_per_rank if parallel.pp_schedule in INTERLEAVED else 1
        if parallel.pp * per_rank > shape.layers:
            problems.append(
                f"pipeline parallel: {parallel.pp * per_rank} stages for a model of {shape.layers} decoder layers; "
                f"each stage needs at least one layer: use parallel.pp"
                f"{' × pp_stages_per_rank' if per_rank > 1 else ''} of at most {shape.layers}"
            )
    return problems


def sequence_parallel_for(config: RunConfig, shape: ModelShape | None) -> tuple[bool, list[str]]:
    """parallel.sequence_parallel settled: auto is on when tp > 1 divides data.seq_len and the family declares
    its norms (`shape`; without it, whatever the family). And the problems of true: tp 1, no declared norms, a
    sequence tp does not divide."""
    parallel, seq_len = config.parallel, config.data.seq_len
    norms_problem = shape.sp_problem if shape is not None else None
    if parallel.sequence_parallel == "auto":
        on = parallel.tp > 1 and norms_problem is None and seq_len % parallel.tp == 0
    else:
        on = parallel.sequence_parallel
    if not on:
        return False, []
    if parallel.tp == 1:
        return False, ["parallel.sequence_parallel = true splits the sequence over the tp ranks, and parallel.tp is 1; "
                       "set parallel.tp > 1 or parallel.sequence_parallel: false"]
    if norms_problem:
        return False, [norms_problem]
    if seq_len % parallel.tp:
        below = seq_len // parallel.tp * parallel.tp
        multiples = sorted({below or parallel.tp, below + parallel.tp})
        return False, [f"data.seq_len = {seq_len} is not a multiple of parallel.tp = {parallel.tp}, which sequence "
                       f"parallelism splits it over; use {' or '.join(map(str, multiples))}, or "
                       "parallel.sequence_parallel: false"]
    return True, []


# ---- the batch ---------------------------------------------------------------------------------------------
def global_batch_size(train: TrainConfig, dp: int) -> int:
    """Sequences per optimizer step: train.global_batch_size, or micro_batch_size × grad_accum × `dp` ranks."""
    if train.grad_accum is not None:
        return train.micro_batch_size * train.grad_accum * dp
    return train.global_batch_size


def batch_layout(train: TrainConfig, parallel: ParallelConfig, dp: int
                 ) -> tuple[tuple[int, int, int] | None, list[str]]:
    """(global batch, micro batch, forwards per rank per step) on `dp` data-parallel ranks, and the problems.

    The micro batch is train.micro_batch_size capped at a rank's share of the global batch, so that a config
    runs, and resumes, on any number of ranks. Under pp it is a rank's share divided into parallel.microbatches
    (default: train.grad_accum when given, else pp).
    """
    batch = global_batch_size(train, dp)
    problem = rows_problem(batch, dp)
    if problem:
        return None, [problem]
    per_rank = batch // dp
    if parallel.pp > 1:
        count = parallel.microbatches or train.grad_accum or parallel.pp
        problem = microbatch_problem(count, per_rank, parallel, dp, batch)
        return (None, [problem]) if problem else ((batch, per_rank // count, count), [])
    micro = min(train.micro_batch_size, per_rank)
    if per_rank % micro:
        return None, [f"train.micro_batch_size = {micro} does not divide the {per_rank} sequences each of the {dp} "
                      f"ranks gets per step (train.global_batch_size = {batch}); use one of {divisors(per_rank)}"]
    return (batch, micro, per_rank // micro), []


def rows_problem(batch: int, dp: int) -> str | None:
    """Why a global batch of `batch` rows cannot be dealt to `dp` data-parallel ranks, or None."""
    if batch % dp:
        near = sorted({max(dp, batch // dp * dp), (batch // dp + 1) * dp})
        fits = [n for n in divisors(batch) if n <= 4 * dp]
        return (f"train.global_batch_size = {batch} is not divisible by the {dp} data-parallel ranks; use a multiple "
                f"of {dp} ({' or '.join(map(str, near))}), or a data-parallel degree in {fits}, or the batch per rank "
                "(train.micro_batch_size × train.grad_accum), which fits any rank count")
    if batch // dp > MAX_STREAMS_PER_RANK:  # each row is a stream with its own reader and window of documents
        return (f"train.global_batch_size = {batch:,} puts {batch // dp:,} sequences of every step on each of the "
                f"{dp} data-parallel ranks; at most {MAX_STREAMS_PER_RANK:,} per rank (each is a data stream with its "
                "own position): lower it or use more ranks")
    return None


def microbatch_problem(count: int, per_rank: int, parallel: ParallelConfig, dp: int, batch: int) -> str | None:
    """Why `count` pipeline microbatches cannot split a rank's `per_rank` rows, or None.

    Under interleaved_1f1b torch also runs them in rounds of pp: the count must be a multiple of
    max(1, count // pp).
    """
    interleaved = parallel.pp_schedule in INTERLEAVED

    def fits(n: int) -> bool:
        return per_rank % n == 0 and (not interleaved or n % max(1, n // parallel.pp) == 0)

    if fits(count):
        return None
    if per_rank % count:
        problem = (f"does not divide the {per_rank} sequences each of the {dp} data-parallel ranks gets per step "
                   f"(global batch {batch})")
    else:  # torch's ScheduleInterleaved1F1B runs max(1, n // pp) rounds of equal size
        problem = (f"is not a multiple of max(1, microbatches // pp) = {count // parallel.pp}, as interleaved_1f1b "
                   "needs")
    return f"parallel.microbatches = {count} {problem}; use one of {[n for n in range(1, per_rank + 1) if fits(n)]}"


def apply_layout(config: RunConfig, layout: Layout) -> RunConfig:
    """`config` with the resolved batch written in: the global batch (the run's config.yaml then holds it, which a
    resume needs) and, under pp, the microbatches."""
    parallel = {"microbatches": layout.grad_accum} if layout.degree("pp") > 1 else {}
    return config.updated(train={"grad_accum": None, "global_batch_size": layout.global_batch}, parallel=parallel)


