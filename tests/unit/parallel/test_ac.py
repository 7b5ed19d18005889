"""Activation checkpointing keeps fewer activations for backward, recomputes what it did not keep, and computes
the same losses and gradients.

Kept activations are counted as the bytes autograd saves for backward outside checkpointed blocks (what stays
alive between forward and backward), not as process memory, which allocator and import noise blur. Recomputation
is counted as the aten ops that run during backward."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from clustertrain.model.build import block_classes
from clustertrain.parallel.ac import apply_activation_checkpointing

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.0)
MODES = ("none", "every_n", "selective", "full")
aten = torch.ops.aten


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, CONFIG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))


def checkpointed(base, mode: str) -> torch.nn.Module:
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, mode, every=2, blocks=block_classes(model))
    return model


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss  # as training calls it


def saved_bytes_and_grads(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(model, tokens)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params), grads


def test_full_keeps_less_than_every_n_keeps_less_than_none_with_equal_gradients(base, tokens):
    saved, grads = {}, {}
    for mode in MODES:
        saved[mode], grads[mode] = saved_bytes_and_grads(checkpointed(base, mode), tokens)
    assert saved["full"] < saved["every_n"] < saved["none"], saved
    assert saved["selective"] < saved["none"], saved  # what selective keeps lives in its own cache, not seen here
    for mode in ("every_n", "selective", "full"):
        for name, grad in grads["none"].items():
            assert grads[mode][name] == pytest.approx(grad, abs=1e-6), (mode, name)


def test_two_steps_give_the_same_losses_and_weights_in_every_mode(base, tokens):
    results = {}
    for mode in MODES:
        model = checkpointed(base, mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            loss = loss_of(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results[mode] = losses, [p.detach().clone() for p in model.parameters()]
    for mode in ("every_n", "selective", "full"):
        assert results[mode][0] == pytest.approx(results["none"][0], abs=1e-6), mode
        for got, expected in zip(results[mode][1], results["none"][1]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=mode)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while it is on."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(model: torch.nn.Module, tokens: torch.Tensor) -> Counter:
    loss = loss_of(model, tokens)
    with OpCounter() as counter:
        loss.backward()
    return counter.ops


def test_selective_keeps_matmuls_and_attention_and_recomputes_the_rest(base, tokens):
    ops = {mode: backward_ops(checkpointed(base, mode), tokens) for mode in ("none", "selective", "full")}
    total = {mode: sum(counted.values()) for mode, counted in ops.items()}
    assert total["none"] < total["selective"] < total["full"], total
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    layers = CONFIG.num_hidden_layers
    assert (ops["none"][attention], ops["selective"][attention], ops["full"][attention]) == (0, 0, layers)
    # per block 7 linears (q, k, v, o, gate, up, down): full reruns 6 (the recompute stops before down, whose
    # output backward does not need), selective the 3 it did not keep (k, o, up: every second one)
    assert ops["full"][aten.mm.default] - ops["none"][aten.mm.default] == 6 * layers
    assert ops["selective"][aten.mm.default] - ops["none"][aten.mm.default] == 3 * layers
    # the norms (two a block) are recomputed, as in full
    assert ops["selective"][aten.rsqrt.default] == ops["full"][aten.rsqrt.default] > ops["none"][aten.rsqrt.default]


def test_a_bad_checkpointing_value_is_one_line_naming_the_valid_ones(capsys):
    from clustertrain.cli import main

    code = main(["config", "check", "--world", "1", "--set", "parallel.activation_checkpoint=op"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "parallel.activation_checkpoint" in lines[0]
    assert all(f"'{mode}'" in lines[0] for mode in MODES), lines[0]
