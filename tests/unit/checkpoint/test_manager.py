"""CheckpointManager's choices that need no real save."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from clustertrain.checkpoint.manager import CheckpointManager
from clustertrain.config.schema import CheckpointConfig


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("setting", "device", "is_async", "pinned"), [
    ("auto", "cuda", True, True),  # GPUs: the step waits only for a copy into pinned host memory
    ("auto", "cpu", False, False),
    (True, "cpu", True, False),
    (False, "cuda", False, False),
])
def test_async_saves_by_default_on_gpus_through_pinned_memory(one_rank, tmp_path, setting, device, is_async, pinned):
    config = CheckpointConfig.model_validate({"async": setting})
    manager = CheckpointManager(tmp_path, config, 10, print, torch.device(device))
    assert manager.async_save is is_async
    assert (manager._writer is not None and manager._writer.cache_staged_state_dict) is pinned
