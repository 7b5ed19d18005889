"""Checkpoints on a GPU: `checkpoint.async: auto` saves in the background from pinned host memory; a SIGTERM
saves and stops; the resume, with the CUDA RNG restored (dropout draws from it) at another count of visible GPUs
where the node has several, ends bit-identical to a run never stopped."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import (SLOW_WRITE_ENV, final_weights, grad_norms, losses, slow_checkpoint_writes, start, train,
                     wait_for_step)

from clustertrain.errors import ExitCode
from clustertrain.train.metrics import read_metrics

# attention dropout draws from the CUDA generator at every step; eager attention and float32 keep every kernel
# deterministic (sdpa's fused backward kernels accumulate with atomics)
RUN = ["model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
       "num_key_value_heads: 2, max_position_embeddings: 256, attention_dropout: 0.1}",
       "model.attn_implementation=eager", "parallel.param_dtype=float32", "train.steps=8", "checkpoint.every=2"]
SLOW_WRITE_S = 4.0


@pytest.fixture(autouse=True)
def deterministic_cublas(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture
def slow_writes(monkeypatch, tmp_path_factory):
    slow_checkpoint_writes(monkeypatch, tmp_path_factory.mktemp("slowed-writer"), SLOW_WRITE_S)


def test_sigterm_saves_and_the_resume_on_another_gpu_count_ends_bit_identical(tmp_path, slow_writes, monkeypatch):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0] if visible else "0"
    # the run stopped sees every GPU of the node (CUDA_VISIBLE_DEVICES as it is); the others see the first one
    proc = start(tmp_path / "stopped", *RUN, nproc=None)
    wait_for_step(tmp_path / "stopped", 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == ExitCode.REQUEUE, stderr[-3000:]
    stopped = max(losses(tmp_path / "stopped"))
    assert f"stopped by SIGTERM at step {stopped}" in stderr and 3 <= stopped < 8
    # auto on a GPU: the step that saves waits for a copy into pinned host memory, not for the slowed write
    blocking = [r["checkpoint_blocking_s"] for r in read_metrics(tmp_path / "stopped" / "metrics.jsonl")
                if "checkpoint_blocking_s" in r]
    assert blocking and blocking[0] < SLOW_WRITE_S / 2, blocking

    monkeypatch.delenv(SLOW_WRITE_ENV)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first)
    resumed = train(tmp_path / "stopped", *RUN)
    checkpoint = tmp_path / "stopped" / "checkpoints" / f"step-{stopped:07d}"
    assert f"resuming from {checkpoint} at step {stopped}" in resumed.stdout
    train(tmp_path / "never", *RUN)
    assert losses(tmp_path / "stopped") == losses(tmp_path / "never")
    assert grad_norms(tmp_path / "stopped") == grad_norms(tmp_path / "never")
    ours, theirs = final_weights(tmp_path / "stopped", 8), final_weights(tmp_path / "never", 8)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name

