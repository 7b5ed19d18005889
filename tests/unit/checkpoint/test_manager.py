"""CheckpointManager's choices that need no real save, and StopRequests' handling of signals and the walltime."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from clustertrain.checkpoint.manager import CheckpointManager
from clustertrain.config.schema import CheckpointConfig, walltime_seconds
from clustertrain.distributed.stop import StopRequests, listen_early


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


def test_ctrl_c_asks_for_a_save_and_a_second_one_exits_at_once():
    stop = StopRequests(None, 0)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.close()


def test_a_signal_before_the_trainer_listens_is_kept_for_step_1_and_a_second_ctrl_c_after_it_exits():
    with listen_early() as early:
        os.kill(os.getpid(), signal.SIGTERM)  # while torch imports
        stop = StopRequests(None, 0)
        assert stop.agreed() == "SIGTERM"
        stop.close()
        with pytest.raises(KeyboardInterrupt):  # the run is already stopping: Ctrl-C means now
            os.kill(os.getpid(), signal.SIGINT)
    assert early.received == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize(("walltime", "margin", "due_after"), [
    ("0:02", 1, 1.0),  # Slurm's MM:SS: 2 s, less the margin
    (1.5, 0, 1.5),  # a number: seconds
])
def test_the_walltime_stops_the_run_at_its_limit_less_the_margin(walltime, margin, due_after):
    start = time.monotonic()
    stop = StopRequests(walltime_seconds(walltime), margin)
    try:
        assert stop.agreed() is None
        while stop.agreed() is None and time.monotonic() - start < 30:
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        assert stop.agreed() == "walltime"
        assert due_after <= elapsed < due_after + 1.0, elapsed  # not at 2 minutes, and not before its time
    finally:
        stop.close()


def test_an_unlimited_walltime_never_stops_the_run():
    stop = StopRequests(walltime_seconds("UNLIMITED"), 300)
    try:
        assert stop.deadline == float("inf") and stop.agreed() is None
    finally:
        stop.close()
