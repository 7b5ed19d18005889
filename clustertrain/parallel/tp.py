"""Tensor parallelism from the model's own plan: transformers' `base_model_tp_plan`, or its family's
(`clustertrain.model.families`, e.g. OPT), as `clustertrain.model.spec.tp_plan` finds it; then the vocabulary
(`clustertrain.parallel.vocab`).

A plan maps module-name patterns (relative to the base model, `*` for a layer index) to styles. Column-wise
linears split their outputs over the tp ranks, row-wise linears their inputs and sum the results, so a block's
attention heads and MLP columns are divided among the ranks.

Sequence parallelism (torchtitan's, with `SequenceParallel` and the `Shard(1)` layouts) also splits what the
blocks leave whole: the residual stream, the norms and dropout run on the tp rank's slice of the sequence.

- Between blocks the stream is a `Shard(1)` DTensor: the token embedding's output (and OPT's learned positions,
  added to it) is sliced there, and HF's code outside the blocks (masks, rotary embeddings) sees whole shapes.
- Inside a block it is the local slice [b, t/tp, h] (or OPT's flattened [b·t/tp, h]: the token dimension is
  -2). The family's norms (`spec.norms`) run on it with their weights replicated; the input of attention and of
  the MLP is all-gathered to the whole sequence (the colwise linears' parent, or the linear itself where its
  parent is the block), and the row-wise outputs are reduce-scattered back to the slice.
- The final norm's output, the head's input, is a `Shard(1)` DTensor. A pipeline stage sends its local slice.

Dropout then draws one mask per rank for its slice, from the rank's own random state: reproducible and restored on
resume, but not the mask one rank draws for the whole sequence. Inside the blocks it runs on local tensors, on any
device; outside them (Phi's embedding dropout, on the stream's DTensor) DTensor's RNG tracker, which would draw
one rank's mask, does not run on CPU meshes.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from clustertrain.errors import ConfigError
from clustertrain.model.families import family_of
from clustertrain.model.spec import TP_STYLES, norms, tp_plan
from clustertrain.parallel.vocab import input_embedding, shard_vocabulary

STYLES: dict[str, ParallelStyle] = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
}
assert set(STYLES) == set(TP_STYLES), "clustertrain.model.spec.TP_STYLES names the styles a plan may use"
TOKENS = Shard(-2)  # inside a block: the token dimension of [b, t, h] or of OPT's flattened [b·t, h]
# Under sequence parallelism the row-wise outputs are reduce-scattered over the tokens instead of summed whole.
SEQUENCE_STYLES: dict[str, ParallelStyle] = {
    **STYLES,
    "rowwise": RowwiseParallel(output_layouts=TOKENS),
    "rowwise_split_input": RowwiseParallel(input_layouts=Replicate(), output_layouts=TOKENS),
}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split `model`'s linears over `tp_mesh` by its plan, and its vocabulary; LoRA adapters on those linears are
    split to match. `sequence_parallel` (settled by clustertrain.config.layout) also splits the sequence
    between the linears."""
    from clustertrain.lora import is_lora

    hf_model = model.get_base_model() if is_lora(model) else model
    config, base, tp = hf_model.config, hf_model.base_model, tp_mesh.size()
    assert not getattr(config, "num_attention_heads", 0) % tp, "clustertrain.config.layout refuses this at start"
    plan = tp_plan(config)
    for pattern, style in plan.items():
        matched = [m for name, m in base.named_modules() if _matches(pattern, name)]
        if not matched:
            raise ConfigError(f"parallel.tp: no module of {config.model_type!r} matches its plan's {pattern!r}")
        for module in matched:
            _parallelize(module, style, tp_mesh, sequence_parallel)
    family = family_of(config.model_type)
    for pattern, attribute in (family.local_head_counts if family else {}).items():
        for name, module in base.named_modules():
            if _matches(pattern, name):
                setattr(module, attribute, getattr(module, attribute) // tp)
    if sequence_parallel:
        _split_sequence(hf_model, plan, tp_mesh)
    shard_vocabulary(hf_model, tp_mesh, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        _slice_stream_ends(model, hf_model, tp_mesh)


def _parallelize(module: nn.Module, style: str, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    styles = SEQUENCE_STYLES if sequence_parallel else STYLES
    if not hasattr(module, "base_layer"):
        parallelize_module(module, tp_mesh, styles[style])
        return
    # A LoRA layer computes base(x) + B(A(x)). Column-wise: split B's outputs like the base's, keep A whole.
    # Row-wise: split A's inputs like the base's (A's output is then summed), keep B whole.
    parallelize_module(module.base_layer, tp_mesh, styles[style])
    colwise = style.startswith("colwise")
    for adapter in (module.lora_B if colwise else module.lora_A).values():
        parallelize_module(adapter, tp_mesh, styles[style])
    if not sequence_parallel:
        return
    # Whole adapters then see DTensors: A the gathered input (column-wise), B A's token slice (row-wise). Their
    # weights become replicated DTensors, whose partial gradients FSDP sums over the tp ranks.
    for adapter in (module.lora_A if colwise else module.lora_B).values():
        if colwise:
            _replicate_weights(adapter, tp_mesh)
        else:
            _sequence_parallel(adapter, tp_mesh, TOKENS.dim, use_local_output=True)


def _split_sequence(hf_model: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh) -> None:
    """Sequence parallelism between the linears `apply_tp` split by `plan`: see the module docstring."""
    config, base = hf_model.config, hf_model.base_model
    layer = _layer_pattern(plan)
    gathered = {_gather_point(pattern, layer) for pattern, style in plan.items() if style.startswith("colwise")}
    for name, module in base.named_modules():
        if any(_matches(pattern, name) for pattern in gathered):
            # prepended: before the hook of a linear's own style (OPT's fc1), which takes its input as whole
            module.register_forward_pre_hook(_on_hidden(lambda x: _gather(x, tp_mesh)), with_kwargs=True,
                                             prepend=True)
        elif _matches(layer, name):
            module.register_forward_pre_hook(_on_hidden(lambda x: _local_slice(x, tp_mesh)), with_kwargs=True)
            module.register_forward_hook(lambda _, args, out: _sequence_dtensor(out, tp_mesh, sliced=True))
    for pattern in norms(config):
        in_block = "*" in pattern
        for name, module in base.named_modules():
            if _matches(pattern, name):
                _sequence_parallel(module, tp_mesh, TOKENS.dim if in_block else 1, use_local_output=in_block)
    family = family_of(config.model_type)
    for pattern in family.positions if family else ():
        for name, module in base.named_modules():
            if _matches(pattern, name):
                module.register_forward_hook(lambda _, args, out: _sequence_dtensor(out, tp_mesh, sliced=False))


def _slice_stream_ends(top: nn.Module, hf_model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The token embedding's output as the stream's Shard(1) DTensor, and the head's input gathered where the
    head stayed whole (vocab.py leaves a LoRA-adapted head so); a pipeline stage's ends; a whole model's
    sequences padded to a multiple of tp (generation grows them a token at a time)."""
    embedding = input_embedding(hf_model)
    if embedding is not None:
        embedding.register_forward_hook(
            lambda _, args, out: _sequence_dtensor(out, tp_mesh, sliced=out.shape[1] != args[0].shape[1]))
    head = getattr(hf_model, "lm_head", None)
    if head is not None and not isinstance(head.weight, DTensor):
        parallelize_module(head, tp_mesh, PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                             use_local_output=True))
    if hasattr(hf_model, "stage_index"):
        if not hf_model.is_first:
            hf_model.register_forward_pre_hook(
                lambda _, args: (_sequence_dtensor(args[0], tp_mesh, sliced=True), *args[1:]))
        if not hf_model.is_last:
            hf_model.register_forward_hook(lambda _, args, out: (out[0].to_local(), *out[1:]))
    else:  # on the model called, peft's or HF's: peft calls the HF model's forward past its hooks
        top.register_forward_pre_hook(lambda m, args, kwargs: _pad(m, args, kwargs, tp_mesh.size()), with_kwargs=True)
        top.register_forward_hook(_unpad)


def _gather(x: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """A rank's token slice all-gathered: a Replicate DTensor, whose backward reduce-scatters the partial
    gradients of the split linears it feeds."""
    return DTensor.from_local(x, tp_mesh, [TOKENS], run_check=False).redistribute(placements=[Replicate()])


def _local_slice(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """The stream entering a block: this rank's slice [b, t/tp, h] of the Shard(1) DTensor."""
    if not isinstance(x, DTensor):
        return x
    return (x if x.placements == (Shard(1),) else x.redistribute(placements=[Shard(1)])).to_local()


def _sequence_dtensor(out, tp_mesh: DeviceMesh, sliced: bool):
    """A module's output (or the first of its outputs) as the stream's Shard(1) DTensor: a local tensor is this
    rank's slice (`sliced`) or the whole sequence, which each rank holds alike."""
    first = out[0] if isinstance(out, tuple) else out
    if isinstance(first, DTensor):
        stream = first if first.placements == (Shard(1),) else first.redistribute(placements=[Shard(1)])
    elif sliced:
        stream = DTensor.from_local(first, tp_mesh, [Shard(1)], run_check=False)
    else:
        stream = DTensor.from_local(first, tp_mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
    return (stream, *out[1:]) if isinstance(out, tuple) else stream


def _on_hidden(transform):
    """A forward pre-hook (with kwargs) that applies `transform` to the hidden states: the first positional
    argument, else the `hidden_states` keyword (HF blocks call attention so), and leaves the rest alone (masks,
    rotary embeddings: whole-sequence values)."""

    def hook(module, args, kwargs):
        if args:
            return (transform(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": transform(kwargs["hidden_states"])}

    return hook


def _pad(module: nn.Module, args: tuple, kwargs: dict, tp: int):
    """Right-pad the ids (and positions, mask) to a multiple of `tp`: later tokens do not change a causal LM's
    earlier logits, and `_unpad` cuts the padding off them."""
    ids = args[0] if args else kwargs.get("input_ids")
    module._unpadded_length = length = None if ids is None else ids.shape[1]
    extra = 0 if ids is None else -length % tp
    if not extra:
        return None
    kwargs = dict(kwargs)
    if args:
        args = (F.pad(ids, (0, extra)), *args[1:])
    else:
        kwargs["input_ids"] = F.pad(ids, (0, extra))
    positions = kwargs.get("position_ids")
    if positions is not None:
        kwargs["position_ids"] = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1).to(positions)], 1)
    if kwargs.get("attention_mask") is not None:
        kwargs["attention_mask"] = F.pad(kwargs["attention_mask"], (0, extra), value=1)
    return args, kwargs


def _unpad(module: nn.Module, args, output):
    logits, length = output.logits, module._unpadded_length
    if length is not None and logits.dim() == 3 and logits.shape[1] != length:  # not a loss: logits
        output.logits = logits[:, :length]
    return output


def _sequence_parallel(module: nn.Module, tp_mesh: DeviceMesh, sequence_dim: int, use_local_output: bool) -> None:
    """torch's SequenceParallel on `module`, whose frozen weights (LoRA's base) stay frozen: the style makes
    every weight trainable again."""
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    parallelize_module(module, tp_mesh, SequenceParallel(sequence_dim=sequence_dim, use_local_output=use_local_output))
    for name, param in module.named_parameters():
        param.requires_grad_(name not in frozen)


def _replicate_weights(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        replicated = DTensor.from_local(param.data, tp_mesh, [Replicate()], run_check=False)
        module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _layer_pattern(plan: dict[str, str]) -> str:
    """The decoder layers' pattern, from the plan's names (`layers.*.self_attn.q_proj` -> `layers.*`)."""
    layers = {pattern.split("*")[0] + "*" for pattern in plan}
    assert len(layers) == 1, f"a tp plan over one list of layers: {sorted(layers)}"
    return layers.pop()


def _gather_point(pattern: str, layer: str) -> str:
    """Where a column-wise linear's input is gathered: its parent (attention, MLP), once for all its linears;
    the linear itself when its parent is the block (OPT's fc1)."""
    parent = pattern.rpartition(".")[0]
    return pattern if parent == layer else parent


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None
