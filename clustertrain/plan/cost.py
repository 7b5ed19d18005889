"""What a step costs on a layout: FLOPs, communication per mesh dimension, and the time of each on a device.

The model (assumptions, each a choice a reader can check against a measured run, docs/plan.md):

* compute: the model FLOPs of a step (6N + 12LHQT per token, `model.estimate`) split evenly over the ranks,
  plus the forward recomputed under activation checkpointing, at `efficiency` × the device's peak; tp splits
  the output head by vocabulary rows too (`clustertrain.parallel.vocab`), and a head it leaves whole (one peft
  adapted) is computed in full by every tp rank (`rank_flops_per_token`);
* a pipeline idles (pp - 1) / (microbatches + pp - 1) of the step (divided by the stages per rank when
  interleaved);
* data-parallel traffic (FSDP's all-gathers and reduce-scatters, DDP's and hybrid's all-reduces) overlaps
  the compute, so only what exceeds it shows; tensor- and pipeline-parallel traffic sits on the critical path;
* collectives are rings: an all-gather or reduce-scatter of B bytes over n ranks moves (n - 1) / n × B per
  rank, an all-reduce twice that; a group inside one node runs at the intra-node bandwidth, one that spans
  nodes at the inter-node bandwidth (ranks fill nodes in the mesh's order, config.layout.DIMS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from clustertrain.config.layout import DIMS, Layout
from clustertrain.config.schema import RunConfig


@dataclass(frozen=True)
class Device:
    """What the plan assumes of one rank's device and its links."""

    name: str
    memory_bytes: float | None
    peak_flops: float | None  # at the run's compute dtype
    intra_node_bps: float | None  # bytes/s per direction to the node's other devices
    inter_node_bps: float | None  # bytes/s per direction across nodes, per device
    per_node: int
    efficiency: float = 0.5  # the fraction of peak FLOP/s that the step's matmuls reach


@dataclass
class Traffic:
    """Bytes one rank sends per step in each mesh dimension, and at what bandwidth."""

    bytes: dict[str, float] = field(default_factory=dict)
    what: dict[str, str] = field(default_factory=dict)
    inside_node: dict[str, bool] = field(default_factory=dict)

    def add(self, dim: str, nbytes: float, what: str) -> None:
        if nbytes > 0:
            self.bytes[dim] = self.bytes.get(dim, 0.0) + nbytes
            self.what[dim] = f"{self.what[dim]}, {what}" if dim in self.what else what

    def seconds(self, dim: str, device: Device) -> float | None:
        bandwidth = device.intra_node_bps if self.inside_node.get(dim, True) else device.inter_node_bps
        return self.bytes[dim] / bandwidth if bandwidth else None


def inside_node(layout: Layout, dim: str, per_node: int) -> bool:
    """Whether the ranks of one group of mesh dimension `dim` sit on one node."""
    span = 1
    for name in reversed(DIMS):  # the innermost dimension's ranks are adjacent
        span *= layout.degree(name)
        if name == dim:
            return span <= per_node
    raise ValueError(dim)


def traffic(config: RunConfig, layout: Layout, params_bytes: int, trainable_bytes: int, param_itemsize: int,
            hidden: int, layers: int, per_node: int) -> Traffic:
    """Bytes per step one rank sends, by mesh dimension. `params_bytes`/`trainable_bytes`: this rank's (sharded)
    parameters in their stored dtype (float32 masters), `param_itemsize`: the compute dtype's bytes."""
    parallel, out = config.parallel, Traffic()
    compute_ratio = param_itemsize / 4  # FSDP gathers in the compute dtype what it stores in float32
    reduce_ratio = (2 if parallel.reduce_dtype == "bfloat16" else 4) / 4
    accum, rows, seq = layout.grad_accum, layout.micro_batch, config.data.seq_len
    if layout.wrapper == "fsdp":  # sharded over dp_shard; with dp_replicate > 1 (hybrid) replicated across it
        ring = layout.degree("dp_shard") - 1  # a rank sends its shard to each of its n - 1 peers: (n - 1)/n of the whole
        gathers = 2 if parallel.strategy.endswith("zero3") else 1
        out.add("dp_shard", gathers * accum * ring * params_bytes * compute_ratio,
                f"{gathers} all-gather{'s' if gathers > 1 else ''} of the weights per microbatch")
        out.add("dp_shard", accum * ring * trainable_bytes * reduce_ratio, "reduce-scatter of the gradients")
        if layout.degree("dp_replicate") > 1:
            r = layout.degree("dp_replicate")
            out.add("dp_replicate", 2 * (r - 1) / r * accum * trainable_bytes * reduce_ratio,
                    "all-reduce of the gradient shards")
    elif layout.wrapper == "ddp":
        n = layout.dp
        out.add("dp_replicate", 2 * (n - 1) / n * trainable_bytes, "all-reduce of the gradients")
    if layout.degree("tp") > 1:
        t = layout.degree("tp")
        recompute = {"full": 2, "every_n": 2 / parallel.activation_checkpoint_every}.get(
            parallel.activation_checkpoint, 0)  # selective keeps the collectives' outputs
        activation = rows * seq * hidden * param_itemsize
        per_layer = (4 + recompute) * 2 * (t - 1) / t * activation
        out.add("tp", accum * layers / layout.degree("pp") * per_layer, f"{4 + recompute:g} all-reduces per block")
    if layout.degree("pp") > 1:
        out.add("pp", 2 * accum * rows * seq * hidden * param_itemsize, "activations and their gradients")
    out.inside_node = {dim: inside_node(layout, dim, per_node) for dim in out.bytes}
    return out


def recompute_factor(config: RunConfig) -> float:
    """Hardware FLOPs over model FLOPs: a recomputed forward is a third of forward + backward; `selective`
    reruns every second matmul of a block and keeps attention, about half its forward."""
    ac = config.parallel.activation_checkpoint
    if ac == "full":
        return 4 / 3
    if ac == "selective":
        return 1 + 1 / 6
    if ac == "every_n":
        return 1 + 1 / (3 * config.parallel.activation_checkpoint_every)
    return 1.0


def bubble(config: RunConfig, layout: Layout) -> float:
    """The fraction of a step a pipeline stage idles."""
    pp = layout.degree("pp")
    if pp == 1:
        return 0.0
    stages = config.parallel.pp_stages_per_rank if config.parallel.pp_schedule == "interleaved_1f1b" else 1
    return (pp - 1) / stages / (layout.grad_accum + pp - 1)


def rank_flops_per_token(model_flops: float, parts: list[nn.Module], tp: int) -> float:
    """Training FLOPs per token of a rank's even share of a step's tokens (the step's over all ranks), from the
    whole model's `model_flops` (`model.estimate`). Every matmul is split over the tp ranks, the output head's
    included when it is split by vocabulary rows (each tp rank computes logits [..., V/tp]); a head left whole
    costs each tp rank all of it, tp times its even share."""
    heads = [module for part in parts for name, module in part.named_modules() if name.split(".")[-1] == "lm_head"]
    whole = sum(head_flops_per_token(head) for head in heads if not split_by_vocabulary(head))
    return model_flops + (tp - 1) * whole


def head_flops_per_token(head: nn.Module) -> float:
    """The output head's training FLOPs per token: 2·H·V forward, as much for its input's gradient, and as much for
    its weight's unless it is frozen (LoRA)."""
    vocab, hidden = head.weight.shape  # a DTensor's shape is the whole weight's
    return (6.0 if head.weight.requires_grad else 4.0) * vocab * hidden


def split_by_vocabulary(head: nn.Module) -> bool:
    """Whether tp split `head`'s weight by vocabulary rows (Shard(0) on the mesh's tp dimension)."""
    mesh = getattr(head.weight, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return "tp" in names and head.weight.placements[names.index("tp")].is_shard(0)
