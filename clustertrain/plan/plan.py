"""A run's plan: memory per rank by component, the step's time by part, and the communication per mesh dimension,
for any world size, computed on this CPU.

    device = device_from(load_preset("frontier").hardware, per_node=8, dtype="bfloat16")
    plan = make_plan(config, world_size=5120, per_node=8, device=device)
    print(plan.table()); json.dumps(plan.to_json())

Memory comes from building and stepping one rank of each pipeline stage under a fake process group
(`plan.fake`); time from `plan.cost`'s model of the step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from clustertrain.config.layout import Layout, sequence_parallel_for
from clustertrain.config.schema import RunConfig
from clustertrain.model.spec import model_shape
from clustertrain.plan.cost import Device, Traffic, bubble, recompute_factor, traffic
from clustertrain.plan.fake import RankBytes, fake_world, measure_rank

GB = 1e9
FIRST_DEPTH = 4  # the blocks of the shorter of the two models a deep one is grown from
DIRECT_LAYERS = 8  # models this deep (in checkpointing strides) or less are stepped whole
MEMORY_MARGIN = 0.1  # of the device's memory, left to the allocator's fragmentation and the runtime's own


@dataclass
class Plan:
    """What `make_plan` found; every figure is per rank unless its name says otherwise."""

    config: RunConfig
    layout: Layout
    per_node: int
    device: Device
    stages: list[RankBytes]  # one rank of each pipeline stage (its first data-parallel and tp rank)
    traffic: Traffic
    compute_s: float | None
    bubble: float
    comm_s: dict[str, float | None]
    tokens_per_step: int

    @property
    def peak_bytes(self) -> int:
        return max(stage.peak for stage in self.stages)

    @property
    def headroom_bytes(self) -> float | None:
        """Device memory left at the peak, after the margin; negative: it does not fit."""
        if self.device.memory_bytes is None:
            return None
        return self.device.memory_bytes * (1 - MEMORY_MARGIN) - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes is None or self.headroom_bytes >= 0

    @property
    def step_s(self) -> float | None:
        """Compute (with the pipeline's idle share), the data-parallel traffic beyond it, tp and pp traffic."""
        if self.compute_s is None or any(v is None for v in self.comm_s.values()):
            return None
        busy = self.compute_s / (1 - self.bubble)
        dp = sum(s for dim, s in self.comm_s.items() if dim.startswith("dp"))
        return max(busy, dp) + sum(s for dim, s in self.comm_s.items() if not dim.startswith("dp"))

    @property
    def flops_per_rank(self) -> float:
        """The FLOPs one rank computes per step: the model's share, and the forward recomputed under activation
        checkpointing."""
        tokens = self.tokens_per_step / self.layout.world_size
        return self.stages[0].flops_per_token * tokens * recompute_factor(self.config)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step_s if self.step_s else None

    @property
    def mfu(self) -> float | None:
        if not self.step_s or not self.device.peak_flops:
            return None
        model_flops = self.stages[0].flops_per_token * self.tokens_per_step / self.layout.world_size
        return model_flops / (self.step_s * self.device.peak_flops)

    def to_json(self) -> dict:
        """Every figure, in bytes, seconds and FLOPs (for scripts: `clustertrain plan --json`)."""
        return {
            "layout": self.layout.to_json(), "per_node": self.per_node, "device": asdict(self.device),
            "stages": [{**asdict(stage), "peak": stage.peak} for stage in self.stages],
            "peak_bytes": self.peak_bytes, "headroom_bytes": self.headroom_bytes, "fits": self.fits,
            "checkpoint_total_bytes": self.checkpoint_total_bytes,
            "comm_bytes": self.traffic.bytes, "comm_what": self.traffic.what,
            "comm_inside_node": self.traffic.inside_node, "comm_s": self.comm_s,
            "flops_per_rank": self.flops_per_rank, "compute_s": self.compute_s, "bubble": self.bubble, "step_s": self.step_s,
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
        }

    @property
    def checkpoint_total_bytes(self) -> int:
        """All ranks' checkpoint shards: each stage's data-parallel and tp ranks write alike (the first of
        each is the largest under uneven shards, so this is an upper bound)."""
        return sum(stage.checkpoint for stage in self.stages) * (self.layout.world_size // self.layout.degree("pp"))


def make_plan(config: RunConfig, layout: Layout, per_node: int, device: Device) -> Plan:
    """Plan `config` (settled for `layout`'s world: resolve.run.resolve) on `device`, `per_node` ranks per node."""
    ranks_per_stage = layout.world_size // layout.degree("pp")
    stages = [measure_stage(config, layout, stage * ranks_per_stage) for stage in range(layout.degree("pp"))]
    first = stages[0]
    itemsize = 2 if config.parallel.param_dtype in ("bfloat16", "float16") else 4
    sent = traffic(config, layout, first.params, first.trainable, itemsize, first.hidden, first.layers, per_node)
    tokens = layout.global_batch * config.data.seq_len
    plan = Plan(config, layout, per_node, device, stages, sent, None, bubble(config, layout),
                {dim: sent.seconds(dim, device) for dim in sent.bytes}, tokens)
    if device.peak_flops:
        plan.compute_s = plan.flops_per_rank / (device.peak_flops * device.efficiency)
    return plan


def without_sequence_parallel(plan: Plan) -> str | None:
    """One line on what a tp layout planned without sequence parallelism costs: each tp rank keeps the whole
    sequence between blocks. Where it could run, the same layout is planned with it for the difference; None
    for a layout with it, or without tp."""
    config, layout = plan.config, plan.layout
    if layout.degree("tp") == 1 or layout.sequence_parallel:
        return None
    forced = config.model_copy(update={"parallel": config.parallel.model_copy(update={"sequence_parallel": True})})
    _, problems = sequence_parallel_for(forced, model_shape(config.model, config.data.vocab_size))
    if problems:
        return (f"plan: without sequence parallelism each of the {layout.degree('tp')} tp ranks keeps the whole "
                f"sequence between blocks, which cannot be split here: {problems[0]}")
    split = make_plan(config, replace(layout, sequence_parallel=True), plan.per_node, plan.device)
    return (f"plan: without sequence parallelism each of the {layout.degree('tp')} tp ranks keeps the whole "
            f"sequence between blocks: peak {plan.peak_bytes / GB:.2f} GB a rank, against "
            f"{split.peak_bytes / GB:.2f} GB with parallel.sequence_parallel: true")


def measure_stage(config: RunConfig, layout: Layout, rank: int) -> RankBytes:
    """`measure_rank` of `rank`. Without pipeline stages a deep model is measured at two short depths and the
    rest follows: each block holds, keeps and sends the same (its own FSDP shards, its saved activations), so
    every figure grows by the same amount per block (per `activation_checkpoint_every` blocks under every_n
    checkpointing). Planning Llama-3-70B at 1,024 ranks takes seconds this way, not half a minute."""
    stride = config.parallel.activation_checkpoint_every if config.parallel.activation_checkpoint == "every_n" else 1
    layers = model_shape(config.model, config.data.vocab_size).layers
    if layout.degree("pp") > 1 or not layers or layers <= DIRECT_LAYERS * stride or layers % stride:
        with fake_world(layout.world_size, rank):
            return measure_rank(config, layout)
    # at a few blocks the step's peak sits elsewhere (FSDP's prefetch of the next block meets the embeddings and
    # the loss) than in a deep model; from four on, each block adds the same (tests/unit/plan)
    short, longer = (_measure_at_depth(config, layout, rank, depth * stride)
                     for depth in (FIRST_DEPTH, FIRST_DEPTH + 1))
    more = layers // stride - FIRST_DEPTH
    grown = {f.name: getattr(short, f.name) + more * (getattr(longer, f.name) - getattr(short, f.name))
             for f in fields(RankBytes) if f.name not in ("hidden", "layers")}
    return RankBytes(**grown, hidden=short.hidden, layers=layers)


def _measure_at_depth(config: RunConfig, layout: Layout, rank: int, depth: int) -> RankBytes:
    model_fields = {**config.model.config, "num_hidden_layers": depth}
    with fake_world(layout.world_size, rank):
        return measure_rank(config.updated(model={"config": model_fields}), layout)
