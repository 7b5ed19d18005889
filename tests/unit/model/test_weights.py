"""clustertrain/model/weights.py: a materialized meta model holds what transformers builds on a real device."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from clustertrain.model.build import build_meta_model
from clustertrain.model.weights import init_weights

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=256, rope_theta=500000.0)


@pytest.mark.parametrize("arch", ["llama", "phi"])
def test_buffers_such_as_rotary_frequencies_are_computed_as_transformers_computes_them(arch):
    # transformers 4.x fills a rotary embedding's inv_freq only in __init__: on the meta device, nothing (make
    # test-oldest runs this under 4.57).
    config = AutoConfig.for_model(arch, **SHAPE)
    model = build_meta_model(config)
    init_weights(model, torch.device("cpu"), seed=0)
    reference = dict(AutoModelForCausalLM.from_config(config).named_buffers())
    buffers = dict(model.named_buffers())
    assert buffers.keys() == reference.keys() and any("inv_freq" in name for name in buffers)
    for name, buffer in buffers.items():
        torch.testing.assert_close(buffer, reference[name], rtol=0, atol=0, msg=name)
