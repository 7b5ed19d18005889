"""RNG states in checkpoints: a rank saves and restores its own GPU's, whatever number of GPUs it sees."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.checkpoint import rng
from clustertrain.checkpoint.load import load_checkpoint
from clustertrain.checkpoint.train_state import TrainState
from clustertrain.distributed import collectives


class FakeGpus:
    """`count` visible GPUs with a generator state each, standing in for dcp.cuda_rng (no GPU here). A device
    index it does not have raises IndexError, as torch.cuda.default_generators[index] does."""

    def __init__(self, count: int):
        self.states = [torch.randint(0, 256, (16,), dtype=torch.uint8) for _ in range(count)]

    def get(self, device: torch.device) -> torch.Tensor:
        return self.states[device.index].clone()

    def set(self, state: torch.Tensor, device: torch.device) -> None:
        self.states[device.index] = state.clone()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def on_gpus(monkeypatch, count: int, index: int) -> FakeGpus:
    """This rank sees `count` GPUs and trains on `index`."""
    gpus = FakeGpus(count)
    monkeypatch.setattr(rng, "cuda_rng", gpus)
    monkeypatch.setattr(collectives, "_rank_device", torch.device("cuda", index))
    return gpus


def save(root, model, optimizer):
    ckpt.write_shards(root, 2, model, optimizer)
    return ckpt.commit(root, 2, TrainState(step=2, tokens_seen=64, world_size=1), lambda folder: None)


@pytest.fixture
def model():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_rank_saved_on_an_8_gpu_node_resumes_seeing_one_gpu(one_rank, tmp_path, monkeypatch, model):
    """torchrun --nproc 8 saves (rank 3 on cuda:3 of 8), srun --gpus-per-task=1 resumes (cuda:0 of 1)."""
    saving = on_gpus(monkeypatch, 8, 3)
    path = save(tmp_path, *model)
    assert json.loads((path / "rng-0.json").read_text())["cuda"] == [saving.states[3].tolist()]  # its own only
    resuming = on_gpus(monkeypatch, 1, 0)
    load_checkpoint(path, *model)
    assert torch.equal(resuming.states[0], saving.states[3])
    resuming = on_gpus(monkeypatch, 8, 5)  # and back onto a bigger node, on another device index
    load_checkpoint(path, *model)
    assert torch.equal(resuming.states[5], saving.states[3])


def test_a_checkpoint_holding_every_visible_gpu_still_resumes_on_fewer(one_rank, tmp_path, monkeypatch, model):
    """Checkpoints saved before one entry per rank hold the states of all 8 GPUs a rank saw."""
    path = save(tmp_path, *model)
    rng = json.loads((path / "rng-0.json").read_text())
    old = FakeGpus(8)
    (path / "rng-0.json").write_text(json.dumps({**rng, "cuda": [s.tolist() for s in old.states]}))
    resuming = on_gpus(monkeypatch, 1, 0)
    load_checkpoint(path, *model)
    assert torch.equal(resuming.states[0], old.states[0])
    resuming = on_gpus(monkeypatch, 8, 5)  # the same layout again: the rank's own device's entry
    load_checkpoint(path, *model)
    assert torch.equal(resuming.states[5], old.states[5])
