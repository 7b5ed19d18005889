from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from clustertrain.train.step import token_loss_sum


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_restarting_position_ids_keep_packed_documents_apart(model):
    a, b = torch.randint(0, 100, (1, 7)), torch.randint(0, 100, (1, 9))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        alone = model(input_ids=b).logits
        masked = model(input_ids=packed, position_ids=positions, use_cache=False).logits[:, 7:]
        unmasked = model(input_ids=packed).logits[:, 7:]
    assert torch.allclose(masked, alone, atol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3), "without masking the second document sees the first"


def test_training_loss_uses_the_packed_masking(model):
    """token_loss_sum must not let a KV cache switch transformers' packed-sequence masking off."""
    a, b = torch.randint(0, 100, (1, 7)), torch.randint(0, 100, (1, 9))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    labels = torch.full_like(packed, -100)
    labels[:, 7:] = packed[:, 7:]
    with torch.no_grad():
        alone = token_loss_sum(model, b, b)
        packed_loss = token_loss_sum(model, packed, labels, positions)
    assert packed_loss == pytest.approx(alone.item(), rel=1e-5)


def test_loss_sum_ignores_masked_labels(model):
    ids = torch.randint(0, 100, (2, 8))
    labels = ids.clone()
    full = token_loss_sum(model, ids, labels)
    labels[:, :4] = -100
    half = token_loss_sum(model, ids, labels)
    assert 0 < half < full
