"""CheckpointManager: its choices, async saves committed without waiting; StopRequests' signals and walltime."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from clustertrain.checkpoint import dcp as ckpt
from clustertrain.checkpoint.load import load_checkpoint
from clustertrain.checkpoint.manager import CheckpointManager, StandAlone, Tracked
from clustertrain.config.schema import CheckpointConfig, walltime_seconds
from clustertrain.distributed.stop import StopRequests, listen_early
from clustertrain.errors import CheckpointError
from clustertrain.run_dir import RunDir


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
    manager = CheckpointManager(RunDir(tmp_path), config, 10, torch.device(device), StandAlone("{}"))
    assert manager.async_save is is_async
    assert manager.pinned_staging is pinned


@pytest.mark.filterwarnings("ignore:Ignoring pin_memory flag")  # no CUDA here to pin with
def test_pinned_staging_is_torchs_stager_with_non_blocking_copies_else_a_caching_writer(monkeypatch):
    from torch.distributed.checkpoint import staging

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # the stager wants a GPU; none here
    stager = ckpt.pinned_staging()["async_stager"]  # this torch has DefaultStager
    assert isinstance(stager, staging.DefaultStager)
    assert stager._config == staging.StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=True)
    monkeypatch.delattr(staging, "DefaultStager")  # as in torch 2.8
    writer = ckpt.pinned_staging()["storage_writer"]
    assert isinstance(writer, dcp.FileSystemWriter) and writer.cache_staged_state_dict


@pytest.fixture
def held_writes(monkeypatch):
    """Every shard write waits until the test sets the returned Event (at most 30 s): a slow file system."""
    release = threading.Event()
    write = dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        release.wait(30)
        return write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held)
    yield release
    release.set()


def async_manager(run_dir):
    return CheckpointManager(RunDir(run_dir), CheckpointConfig.model_validate({"async": True}), 10, torch.device("cpu"),
                             StandAlone("{}"))


def save(manager, step, model, **kwargs):
    manager.tracked = Tracked(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return manager.save(step, 64 * step, **kwargs)


def test_a_log_step_never_waits_for_an_async_write_and_commits_it_once_done(one_rank, tmp_path, held_writes):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    saved = model.weight.detach().clone()
    manager = async_manager(tmp_path)
    root = tmp_path / "checkpoints"
    assert save(manager, 2, model) is None  # staged and writing in the background
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the checkpoint keeps the weights of step 2
    for _ in range(3):  # log steps while the write is held
        start = time.perf_counter()
        assert manager.commit_if_done() is None
        assert time.perf_counter() - start < 1.0
    assert not (root / "step-0000002").exists()  # nothing half-written is ever visible
    held_writes.set()
    deadline, path = time.monotonic() + 30, None
    while path is None and time.monotonic() < deadline:  # the next log steps: committed once the write is done
        path = manager.commit_if_done()
        time.sleep(0.01)
    assert path == root / "step-0000002" == manager.last
    assert {"train_state.json", ".metadata", "rng-0.json", "config.yaml"} <= {p.name for p in path.iterdir()}
    assert not list(root.glob(".tmp-*"))
    load_checkpoint(path, model, None)
    assert torch.equal(model.weight, saved)


def test_the_next_save_and_the_last_wait_for_a_write_in_flight(one_rank, tmp_path, held_writes):
    model = nn.Linear(4, 2)
    manager = async_manager(tmp_path)
    root = tmp_path / "checkpoints"
    assert save(manager, 2, model) is None
    threading.Timer(0.5, held_writes.set).start()
    start = time.perf_counter()
    assert save(manager, 4, model) is None  # waits for step 2's write, commits it, then starts its own
    assert time.perf_counter() - start >= 0.4
    assert manager.last == root / "step-0000002" and (manager.last / "train_state.json").exists()
    assert manager.finalize(final=True) == root / "step-0000004"  # the run's end waits for the last one
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002", "step-0000004"]


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


@pytest.mark.parametrize("cause, remedy", [("a file", "move away what is in the way"), ("read-only", "writable"),
                                           ("a bug", "report this error")])
def test_a_failed_last_save_says_what_to_do_about_its_cause(one_rank, tmp_path, monkeypatch, cause, remedy):
    """A checkpoints folder replaced by a file, or a read-only one, is not a full disk: "free space" would mislead
    (it said so with 81 GB free)."""
    root = tmp_path / "checkpoints"
    if cause == "a file":
        root.write_text("not a folder")
    elif cause == "a bug":  # as torch 2.11's stager failed on an H100 (KeyError: <class 'type'>): not the disk's
        root.mkdir()

        def broken(*args, **kwargs):
            raise KeyError(type)
        monkeypatch.setattr(ckpt, "_write_json", broken)
    else:
        root.mkdir()

        def read_only(*args, **kwargs):
            raise OSError(30, "Read-only file system")  # EROFS: root ignores permissions, so raised here
        monkeypatch.setattr(ckpt, "_write_json", read_only)
    manager = CheckpointManager(RunDir(tmp_path), CheckpointConfig(), 4, torch.device("cpu"), StandAlone("{}"))
    with pytest.raises(CheckpointError, match=f"steps 1-4 are lost: .*{remedy}") as error:
        save(manager, 4, nn.Linear(4, 2), final=True)
    assert "free space" not in str(error.value)
