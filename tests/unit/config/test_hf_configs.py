"""Real config.json files (tests/fixtures/hf_configs) are accepted whole as model.config, legacy keys included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from clustertrain.cli import main
from clustertrain.model.build import build_hf_config
from clustertrain.resolve.load import load_checked_config

FIXTURES = sorted((Path(__file__).parents[2] / "fixtures" / "hf_configs").glob("*.json"))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_a_real_config_json_is_a_model_config(tmp_path, path):
    fields = json.loads(path.read_text())
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"model": {"arch": fields["model_type"], "config": fields}}))
    hf = build_hf_config(load_checked_config(config_file).model, None, vocab_size=fields["vocab_size"])
    for key in ("hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_key_value_heads", "vocab_size"):
        if key in fields:
            assert getattr(hf, key) == fields[key], key
    if fields.get("rope_theta") is not None:  # transformers 5 reads the legacy key into rope_parameters
        assert hf.rope_parameters["rope_theta"] == fields["rope_theta"]
    if fields.get("rope_scaling"):
        assert hf.rope_parameters["rope_type"] == fields["rope_scaling"]["rope_type"]


def test_legacy_keys_work_with_set_and_typos_still_fail(capsys):
    assert main(["config", "show", "--set", "model.config.rope_theta=500000"]) == 0
    assert main(["config", "show", "--set", "model.config.rope_thetaa=500000"]) == 2
    assert "unknown key 'model.config.rope_thetaa'" in capsys.readouterr().err
    assert main(["config", "show", "--set", "model.config={model_type: gpt2}"]) == 2
    assert "model.config.model_type = 'gpt2' is not model.arch's 'llama'" in capsys.readouterr().err
