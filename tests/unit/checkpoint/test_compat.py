"""Exported config.json files carry transformers 4.x's rope and dtype keys beside 5.x's, and 5.x still reads them
as it wrote them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from clustertrain.checkpoint.compat import legacy_config_keys, write_legacy_config, write_portable_tokenizer_class

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("arch, fields, theta, scaling", [
    ("llama", dict(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), max_position_embeddings=131072), 500000.0,
     LLAMA3_ROPE),
    ("qwen2", dict(rope_theta=1000000.0), 1000000.0, None),
    ("mistral", {}, 10000.0, None),
])
def test_a_saved_config_gets_rope_theta_and_rope_scaling_and_still_loads(tmp_path, arch, fields, theta, scaling):
    original = AutoConfig.for_model(arch, **fields)
    original.dtype = "bfloat16"
    original.save_pretrained(tmp_path)
    write_legacy_config(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_theta"] == theta and written["torch_dtype"] == "bfloat16"
    if scaling:
        assert written["rope_scaling"] == scaling
    else:
        assert "rope_scaling" not in written
    reread = AutoConfig.from_pretrained(tmp_path)
    assert reread.rope_parameters == original.rope_parameters


def test_per_layer_type_rope_gives_the_global_theta_and_the_local_base():
    config = legacy_config_keys({"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})
    assert config["rope_theta"] == 1000000.0 and config["rope_local_base_freq"] == 10000.0
    assert "rope_scaling" not in config


def test_tokenizers_backend_is_renamed_and_a_concrete_class_kept(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    for written, expected in (("TokenizersBackend", "PreTrainedTokenizerFast"), (None, "PreTrainedTokenizerFast"),
                              ("GPT2TokenizerFast", "GPT2TokenizerFast")):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": written, "eos_token": "<e>"}))
        write_portable_tokenizer_class(tmp_path)
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        assert config == {"tokenizer_class": expected, "eos_token": "<e>"}
