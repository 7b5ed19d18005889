"""torchtitan's Llama DCP checkpoints in clustertrain: a tiny one written here with torch.distributed.checkpoint,
under torchtitan's names, imports with the logits of Meta's model, resumes as a checkpoint, exports as Meta's .pth."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from clustertrain.checkpoint.export import import_hf, load_checkpoint_model
from clustertrain.checkpoint.meta import export_meta, read_pth
from clustertrain.checkpoint.torchtitan import import_torchtitan
from clustertrain.cli import main
from clustertrain.errors import CheckpointError
from test_meta import hf_logits, ids, meta_weights, reference_logits, write_meta_folder


def write_torchtitan(folder: Path, weights: dict[str, torch.Tensor], under_model: bool) -> Path:
    """A torchtitan step folder: the model's weights (top level, or under `model.` as older releases and the
    Meta-to-DCP scripts save them), its rotary table, and optimizer and train state beside them."""
    model = {**weights, "freqs_cis": torch.polar(torch.ones(8, 8), torch.rand(8, 8))}
    state = {"model": model} if under_model else dict(model)
    state["optimizer"] = {"state": {"tok_embeddings.weight": {"exp_avg": torch.zeros(3), "step": torch.tensor(5.0)}}}
    state["train_state"] = {"step": 1000, "global_avg_losses": [2.5]}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(state, checkpoint_id=folder)
    return folder


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """The Meta checkpoint torchtitan's run started from: its params.json and tokenizer.model."""
    return write_meta_folder(tmp_path_factory.mktemp("meta") / "original", meta_weights(), shards=1)


@pytest.mark.parametrize("under_model", [False, True], ids=["torchtitan", "torchtitan-older"])
def test_a_torchtitan_checkpoint_imports_resumes_and_exports_with_its_logits(original, tmp_path, under_model):
    weights = {k: v.float() for k, v in meta_weights(seed=2).items()}  # torchtitan keeps fp32 weights
    step = write_torchtitan(tmp_path / "checkpoint" / "step-1000", weights, under_model)
    snapshot = import_torchtitan(step, tmp_path / "hf", params=original)
    logits = hf_logits(snapshot)
    assert torch.allclose(logits, reference_logits(weights, ids()), atol=1e-4, rtol=1e-4)
    assert (snapshot / "tokenizer.json").is_file()

    model, _, _ = load_checkpoint_model(import_hf(snapshot, tmp_path / "ckpt"))  # what `--resume` loads
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, logits)
    exported = read_pth(export_meta(snapshot, tmp_path / "pth") / "consolidated.00.pth")  # dcp_to_llama's .pth
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], v) for k, v in weights.items())


def test_a_torchtitan_checkpoint_without_params_or_weights_is_one_line(original, tmp_path, capsys):
    step = write_torchtitan(tmp_path / "step-10", {k: v.float() for k, v in meta_weights().items()}, False)
    assert main(["import", str(step), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert "pass --params with the params.json" in error and "\n" not in error and not (tmp_path / "out").exists()

    empty = write_torchtitan(tmp_path / "step-20", {"something.else": torch.zeros(2)}, False)
    with pytest.raises(CheckpointError, match="holds no torchtitan Llama weights"):
        import_torchtitan(empty, tmp_path / "out", params=original / "params.json")
    shallow = write_torchtitan(tmp_path / "step-30", {k: v for k, v in meta_weights().items() if "layers.1." not in k},
                               False)
    with pytest.raises(CheckpointError, match="no layers.1.attention.wq.weight, which params.json says"):
        import_torchtitan(shallow, tmp_path / "out", params=original)
