"""The base reference of LoRA checkpoints: a cheap checksum that follows a snapshot's content, not its place."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from clustertrain.checkpoint.base import base_reference, check_base, snapshot_checksum
from clustertrain.errors import CheckpointError


def snapshot(path, seed: int):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.randn(600, 1000, generator=torch.Generator().manual_seed(seed))}, path / "model.safetensors")
    return path


def test_a_copy_has_the_same_checksum_and_other_weights_another(tmp_path):
    a = snapshot(tmp_path / "a", seed=0)
    shutil.copytree(a, tmp_path / "copy")
    assert snapshot_checksum(a) == snapshot_checksum(tmp_path / "copy")
    assert snapshot_checksum(a) != snapshot_checksum(snapshot(tmp_path / "b", seed=1))
    reference = base_reference(a)
    assert reference == {"path": str(a.resolve()), "checksum": snapshot_checksum(a)}
    assert check_base(reference, tmp_path / "step-0000001", tmp_path / "copy") == tmp_path / "copy"


def test_another_or_a_missing_base_is_one_line_naming_both(tmp_path):
    reference = base_reference(snapshot(tmp_path / "a", seed=0))
    other = snapshot(tmp_path / "b", seed=1)
    with pytest.raises(CheckpointError) as error:
        check_base(reference, tmp_path / "step-0000001", other)
    assert str(tmp_path / "a") in str(error.value) and str(other) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        check_base({**reference, "path": str(tmp_path / "gone")}, tmp_path / "step-0000001")
