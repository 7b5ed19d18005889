"""One rank of any world, built and stepped on this CPU: the run's own builders under a fake process group and
fake tensors, with every byte the step allocates counted.

    with fake_world(world_size=5120, rank=0):
        measured = measure_rank(config, layout)      # the trainer's mesh, model, parallelize; one step

The process group is torch's fake backend (collectives return at once, their outputs keep their shapes) and
the weights are FakeTensors (shapes, dtypes and storages, no data), so a rank of Llama-3-8B at 5,120 ranks
builds and steps in seconds in under 1 GB. What fails to build or step here (a tp that does not divide the
heads, a pipeline that does not cut) fails as it would in the run, with the same message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from clustertrain.config.layout import Layout
from clustertrain.config.schema import RunConfig

CPU = torch.device("cpu")
GPU_ATTENTION = ("flash_attention_2", "flex_attention")
DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as `rank` of a fake process group of `world_size` ranks (no other process exists)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a plan needs a process without a process group")
    excepthook = sys.excepthook  # torch wraps it at every init to prefix tracebacks with the rank: once is enough
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _forget_sharding()


def _forget_sharding() -> None:
    """Drop DTensor's sharding-propagation caches. They are keyed by meshes that compare equal across worlds, so
    a real run in this process (`parallel.strategy: auto` plans on every rank, as rank 0) would get this world's
    meshes back in its tensors' specs, with this rank's coordinates: rank 1 then wrote rank 0's shard offsets
    into its first checkpoint, which failed."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()
    else:  # torch 2.8
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_clear()


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated under this mode that are still alive, and their peak.

    A storage is counted once however many views share it, and uncounted when it is freed; FSDP's
    `storage.resize_` (how it frees and re-allocates gathered parameters) is followed too. An op's output that
    shares the storage of one of its inputs allocated nothing: a view of a parameter (`weight.t()` in every
    linear without autocast's cast, LoRA's frozen base) is not a new tensor of the step. Counting it was what made
    a pipeline stage keep a copy of its weights per microbatch in flight, in the plan only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            # a fake tensor has no value to read (`.item()`): the pipeline's P2P warm-up vote reads 1, "static"
            return args[0].dtype.is_floating_point and 1.0 or (True if args[0].dtype == torch.bool else 1)
        out = func(*args, **(kwargs or {}))
        inputs = {id(storage) for storage in _storages((args, kwargs))}
        for storage in _storages(out):
            if id(storage) not in inputs:
                self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[storage] = size
        weakref.finalize(storage, self._free, size)
        self._add(size)

    def _add(self, size: int) -> None:
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, size: int) -> None:
        self.live -= size

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        if storage in self._sizes:
            self._add(size - self._sizes[storage])
            self._sizes[storage] = size

    def reset_peak(self) -> None:
        self.peak = self.live

    def __enter__(self):
        resize = torch.UntypedStorage.resize_

        def tracked_resize(storage, size):
            self._resized(storage, size)
            return resize(storage, size)

        self._restore = resize
        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._restore
        return super().__exit__(*exc)


def _storages(tree) -> list[torch.UntypedStorage]:
    """The storages that hold the data of the tensors in `tree` (nested lists, tuples and dicts)."""
    return [plain.untyped_storage() for tensor in tree_flatten(tree)[0] if isinstance(tensor, torch.Tensor)
            for plain in _plain_tensors(tensor)]


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold a tensor's data: a DTensor's local shard, not the wrapper of its global shape."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [plain for t in inner if isinstance(t, torch.Tensor) for plain in _plain_tensors(t)]


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds, in bytes.

    Attributes:
        params: its parameters (its shards of them, under FSDP or tp), frozen ones included.
        trainable: the trainable part of `params`; its gradients and optimizer states follow it.
        grads: its gradients once reduced (in the trainable parameters' dtype).
        optimizer: AdamW's two moments per trainable parameter (the parameter's dtype) and its step counters.
        buckets: DDP's gradient buckets (a copy of the gradients it all-reduces; 0 under FSDP).
        step_peak: the most the training step allocated at once on top of the parameters (activations, gathered
            parameters, gradients, temporaries), measured.
        activations: what the step kept for the backward at its forward's end: `step_peak`'s largest part.
        checkpoint: what this rank writes to a checkpoint (parameters and optimizer states).
        flops_per_token: the rank's training FLOPs per token of its even share of a step's tokens (the whole
            model's, model.estimate, and a head tp leaves whole: plan.cost.rank_flops_per_token).
        hidden, layers: the model's width and depth, for the activations that tp and pp send.
    """

    params: int
    trainable: int
    grads: int
    optimizer: int
    buckets: int
    step_peak: int
    activations: int
    checkpoint: int
    flops_per_token: float
    hidden: int
    layers: int

    @property
    def peak(self) -> int:
        """The rank's peak: weights, optimizer states and buckets throughout, the step's allocations on top."""
        return self.params + self.optimizer + self.buckets + self.step_peak


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of `tensor` (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(parts: list[nn.Module]) -> tuple[int, int, int]:
    """This rank's parameter bytes, trainable parameter bytes, and AdamW state bytes (exp_avg and exp_avg_sq in
    the parameter's dtype, and a 4-byte step per parameter): what the optimizer holds after its first step."""
    params = trainable = optimizer = 0
    seen: set[int] = set()
    for part in parts:
        for p in part.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            size = local_bytes(p)
            params += size
            if p.requires_grad:
                trainable += size
                optimizer += 2 * size + 4
    return params, trainable, optimizer


def optimizer_state_bytes(optimizers) -> int:
    """The bytes of every tensor in the optimizers' states (a real run's count, after a step)."""
    return sum(local_bytes(v) for o in optimizers for state in o.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def measure_rank(config: RunConfig, layout: Layout, device_type: str = "cpu") -> RankBytes:
    """Build this rank of `layout` exactly as the trainer does (mesh, model, parallelize) with fake weights, run
    one training step of a random batch of the configured shape through it, and count its bytes. Call inside
    `fake_world`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from clustertrain.distributed.mesh import build_mesh
    from clustertrain.model.build import block_classes, build_model
    from clustertrain.model.estimate import model_flops_per_token
    from clustertrain.model.loss import TokenLoss
    from clustertrain.parallel.apply import DTYPES, parallelize
    from clustertrain.plan.cost import rank_flops_per_token

    # flash-attn and flex run on GPUs only; they keep no seq x seq tensor, as sdpa without a mask does not
    kernel = config.model.attn_implementation in GPU_ATTENTION
    if kernel:
        config = config.updated(model={"attn_implementation": "sdpa"})
    dtype = DTYPES[config.parallel.param_dtype]
    built = build_model(config.model, config.lora, None, config.data.vocab_size, param_dtype=dtype, device=CPU,
                        loss=config.train.loss, loss_chunk_tokens=config.train.loss_chunk_tokens,
                        tp=layout.degree("tp"), pipeline=layout.degree("pp") > 1,
                        packed_documents=config.data.packed_documents)
    model_flops = model_flops_per_token(built.model, config.data.seq_len)  # before parallelize changes the model
    hidden, layers = built.hf_config.hidden_size, built.hf_config.num_hidden_layers
    mesh = build_mesh(layout, device_type)
    ddp = layout.wrapper == "ddp"
    if ddp:  # DDP's reducer (C++) cannot wrap fake tensors: the step runs unwrapped, and its buckets are added
        mesh = dataclasses.replace(mesh, layout=dataclasses.replace(layout, wrapper=None))
    fake = FakeTensorMode(allow_non_fake_inputs=True)

    def materialize(model: nn.Module) -> None:
        with fake:
            model.to_empty(device=CPU)

    runner = parallelize(built.model, config.parallel, mesh, CPU, block_classes(built.model), materialize,
                         loss=TokenLoss(), microbatches=layout.grad_accum)
    params, trainable, optimizer = state_bytes(runner.parts)
    flops = rank_flops_per_token(model_flops, runner.parts, layout.degree("tp"))
    rows, seq_len = layout.micro_batch * layout.grad_accum, config.data.seq_len
    with fake:
        vocab = built.hf_config.vocab_size
        batch = {"input_ids": torch.randint(0, vocab, (rows, seq_len)),
                 "labels": torch.randint(0, vocab, (rows, seq_len))}
        if config.data.packed_documents and not kernel:  # sdpa masks documents with a [rows, 1, seq, seq] mask
            batch["position_ids"] = torch.arange(seq_len).repeat(rows, 1)
        scale = torch.tensor(1.0 / (rows * seq_len))
        if layout.degree("pp") > 1:
            step_peak, activations = _pipeline_step(runner, config, layout, batch, scale, hidden)
        else:
            with LiveBytes() as counted, _after_forwards(runner.parts, counted) as kept:
                runner.forward_backward(batch, scale)
            step_peak, activations = counted.peak, max(kept, default=0)
        grads = sum(local_bytes(p.grad) for part in runner.parts for p in part.parameters() if p.grad is not None)
    return RankBytes(params=params, trainable=trainable, grads=grads, optimizer=optimizer,
                     buckets=trainable if ddp else 0, step_peak=step_peak, activations=activations,
                     checkpoint=params + optimizer, flops_per_token=flops, hidden=hidden, layers=layers)


def _pipeline_step(runner, config: RunConfig, layout: Layout, batch: dict, scale: torch.Tensor,
                   hidden: int) -> tuple[int, int]:
    """(step peak, live bytes at the forwards' end) of this rank's pipeline stages: two microbatches through each
    stage, both forwards, then both backwards. What the second forward adds is what each microbatch in flight
    keeps; what the first adds beyond it is the stage's once (FSDP's gathered weights, which stay from forward to
    backward unless resharded), not a microbatch's. The schedule's other microbatches in flight are counted from
    it. (The schedule itself cannot run here: its stages learn their inputs' shapes from each other over the
    process group, which a fake one cannot carry.)"""
    rows, seq = layout.micro_batch, config.data.seq_len
    ids, labels = batch["input_ids"][:rows], batch["labels"][:rows]
    positions = torch.arange(seq).expand(rows, seq).contiguous()
    residual = DTYPES_BY_NAME[config.parallel.param_dtype] if layout.wrapper == "fsdp" else torch.float32
    sent = seq // layout.degree("tp") if layout.sequence_parallel else seq  # a tp rank's slice under sequence parallel
    peaks, kept, once = [], [], []
    rows_in_hand = {"input_ids": ids, "labels": labels, "position_ids": positions}
    with runner.forward_context(rows_in_hand), LiveBytes() as counted:
        for stage in runner.parts:
            counted.reset_peak()
            outputs, added = [], []
            with runner.autocast():
                for _ in range(2):
                    before = counted.live
                    x = ids if stage.is_first else torch.randn(rows, sent, hidden, dtype=residual, requires_grad=True)
                    outputs.append(stage(x, positions, **({"labels": labels} if stage.is_last else {})))
                    added.append(counted.live - before)
                for out in reversed(outputs):
                    if stage.is_last:
                        runner._scaled_loss(out, labels, scale).backward()
                    else:
                        torch.autograd.backward(out[0], torch.ones_like(out[0]))
            del outputs, out
            peaks.append(counted.peak)
            kept.append(added[1])
            once.append(added[0] - added[1])
    in_flight = microbatches_in_flight(config, layout, runner.parts[0].stage_index)
    per_microbatch = sum(kept) // len(kept)
    return max(peaks) + (in_flight - 2) * per_microbatch, max(once) + in_flight * per_microbatch


def microbatches_in_flight(config: RunConfig, layout: Layout, first_stage: int) -> int:
    """Microbatches whose activations a pipeline rank holds at once: all of them under gpipe (every forward
    before any backward), pp - rank under 1f1b (its warm-up forwards), and under interleaved 1f1b its warm-up
    across its stages (torch's ScheduleInterleaved1F1B: 2 (pp - rank - 1) + (v - 1) pp, plus the one in hand)."""
    parallel, pp, microbatches = config.parallel, layout.degree("pp"), layout.grad_accum
    rank = first_stage % pp
    if parallel.pp_schedule == "gpipe":
        return microbatches
    if parallel.pp_schedule == "1f1b":
        return min(microbatches, pp - rank)
    stages = parallel.pp_stages_per_rank
    return min(microbatches * stages, 2 * (pp - rank - 1) + (stages - 1) * pp + 1)


@contextlib.contextmanager
def _after_forwards(parts: list[nn.Module], counted: LiveBytes) -> Iterator[list[int]]:
    """The live bytes after each forward of `parts` (what the backward will need, and the forward's leftovers)."""
    kept: list[int] = []
    hooks = [part.register_forward_hook(lambda *_: kept.append(counted.live)) for part in parts]
    try:
        yield kept
    finally:
        for hook in hooks:
            hook.remove()
