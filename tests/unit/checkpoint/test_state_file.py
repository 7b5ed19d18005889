"""The training stub's checkpoint (`model_state_dict.pt` beside optim_, lr_ and iter_state_dict.pt) imports as a
Hugging Face snapshot with its model's logits, read weights-only: a planted object is refused without running."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml
from transformers import AutoModelForCausalLM

from clustertrain.checkpoint.state_file import import_state_file
from clustertrain.cli import main
from clustertrain.errors import CheckpointError

DIMS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 300}


class Payload:
    """Creates `marker` if unpickled by plain pickle: what an attacker would plant in a .pt."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def stub(tmp_path) -> tuple[Path, Path, torch.nn.Module]:
    """experiments/chkpts/<prefix>.<timestamp>/ as the stub writes it (its DDP `module.` prefix), and a config."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.LlamaConfig(**DIMS)).eval()
    folder = tmp_path / "experiments" / "chkpts" / "dummy-0.1.2024-06-01-12-00"
    folder.mkdir(parents=True)
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, folder / "model_state_dict.pt")
    torch.save({"state": {}, "param_groups": [{"lr": 3e-4}]}, folder / "optim_state_dict.pt")
    torch.save({"epoch": 0, "seg": 1, "start_idx": 0, "end_idx": 10, "loss_min": 2.5}, folder / "iter_state_dict.pt")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"arch": "llama", "config": DIMS}, "data": {"vocab_size": 300}}))
    return folder, config, model


def test_the_stub_s_checkpoint_imports_with_its_logits(stub, tmp_path, capsys):
    folder, config, model = stub
    assert main(["import", str(folder), str(tmp_path / "hf"), "--config", str(config)]) == 0
    assert "model.path=" in capsys.readouterr().out
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    imported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(imported(ids).logits, model(ids).logits)


def test_a_planted_object_is_refused_without_running_and_a_misfit_is_one_line(stub, tmp_path, capsys):
    folder, config, model = stub
    assert main(["import", str(folder), str(tmp_path / "out")]) == 2  # no --config: one line saying to pass it
    assert "pass --config" in capsys.readouterr().err

    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({"model": {"arch": "llama", "config": {**DIMS, "num_hidden_layers": 1}},
                                     "data": {"vocab_size": 300}}))
    with pytest.raises(CheckpointError, match="holds model.layers.1.self_attn.q_proj.weight, which the config's"):
        import_state_file(folder, tmp_path / "out", small)

    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "extra": Payload(marker)}, folder / "model_state_dict.pt")
    with pytest.raises(CheckpointError, match=r"model_state_dict.pt holds code or non-tensor objects \(it refers to "
                                              r"io.open\) and was not loaded"):
        import_state_file(folder, tmp_path / "out", config)
    assert not marker.exists() and not (tmp_path / "out").exists()
