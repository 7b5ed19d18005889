"""Activation checkpointing keeps fewer activations for backward, and computes the same gradients.

Counted as the bytes autograd saves for backward outside checkpointed blocks (what stays alive between
forward and backward), not as process memory, which allocator and import noise blur."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from clustertrain.model.build import block_classes
from clustertrain.parallel.ac import apply_activation_checkpointing

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4)


def saved_bytes_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss  # as training calls it
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params), grads


def test_full_keeps_less_than_selective_keeps_less_than_none_with_equal_gradients():
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 64))
    saved, grads = {}, {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, mode, every=2, blocks=block_classes(model))
        saved[mode], grads[mode] = saved_bytes_and_grads(model, tokens)
    assert saved["full"] < saved["selective"] < saved["none"], saved
    for mode in ("selective", "full"):
        for name, grad in grads["none"].items():
            assert grads[mode][name] == pytest.approx(grad, abs=1e-6), (mode, name)
