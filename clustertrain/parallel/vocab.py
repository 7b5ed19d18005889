"""Vocabulary parallelism: the token embedding and the output head split over the tp ranks by vocabulary rows, so
that no tp rank holds the whole [V, H] weights, the full logits or their gradient.

    shard_vocabulary(hf_model, tp_mesh, sequence_parallel=False)   # the last step of clustertrain.parallel.tp

- The embedding (RowwiseParallel on nn.Embedding): weight Shard(0) of [V, H]; each rank looks up the ids it owns,
  and the outputs are summed (Replicate), or reduce-scattered over the sequence (Shard(1)) under sequence
  parallelism.
- The head (ColwiseParallel): weight Shard(0) of [V, H], bias Shard(0); its input is all-gathered (Shard(1)
  under sequence parallelism, else Replicate); its logits stay a Shard(-1) DTensor, [..., V/tp] on each rank.
  `clustertrain.model.loss` computes the cross entropy over the shards (chunked or full); callers that need
  whole logits (the end-of-run sample, lm-eval) gather them with `model.loss.full_logits`.
- Tied embeddings (OPT, Llamas with tie_word_embeddings): both place the one weight Shard(0) over the same mesh,
  and the head takes the embedding's sharded parameter again: one parameter, saved once, under both names.

A vocabulary that tp does not divide is split as torch.chunk splits it (the first ranks hold ceil(V / tp) rows):
no padding, so checkpoints keep the model's shapes and move between layouts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class _VocabHead(ColwiseParallel):
    """ColwiseParallel whose output hook lets a loss through: a LossHead with targets returns the summed loss,
    already reduced over the vocabulary shards (clustertrain.model.loss), not logits."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def shard_vocabulary(hf_model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split `hf_model`'s token embedding and output head over `tp_mesh` by vocabulary rows, in place.

    `hf_model` is the HF causal LM (the base model under LoRA) or a pipeline stage, which may hold either, both
    or neither. A module peft adapted stays whole (and so does its tied partner).
    """
    embedding, head = input_embedding(hf_model), getattr(hf_model, "lm_head", None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    embedding = embedding if isinstance(embedding, nn.Embedding) else None
    head = head if isinstance(head, nn.Linear) and not hasattr(head, "base_layer") else None
    if tied and (embedding is None or head is None):
        return
    sequence = Shard(1) if sequence_parallel else Replicate()
    if embedding is not None:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence))
        embedding.register_forward_hook(_waited)
    if head is not None:
        parallelize_module(head, tp_mesh, _VocabHead(input_layouts=sequence, output_layouts=Shard(-1),
                                                     use_local_output=False))
    if tied:  # each style registered a parameter of its own: the head takes the embedding's again
        head.weight = embedding.weight


def input_embedding(hf_model: nn.Module) -> nn.Module | None:
    """The token embedding, or None where this part has none (a pipeline stage after the first)."""
    try:
        return hf_model.base_model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def _waited(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a plain tensor: its all-reduce (reduce-scatter under sequence parallelism) returns
    an AsyncCollectiveTensor, which a compiled block takes as an input whose gradient it then gets wrong (its
    tangent metadata is guessed from the subclass). A copy waits for the collective and keeps the autograd graph."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
