"""A rank on a GPU from the start: it binds its GPU and NCCL to it, every strategy trains on one GPU (no wrapper on
one rank), fused AdamW's CUDA kernel trains as foreach does, float16 trains with the sharded loss scaler, and two
ranks on two GPUs train over NCCL as one does."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import LayoutRuns, grad_norms, losses, train

from clustertrain.train.metrics import read_metrics

STEPS = ["train.steps=6", "checkpoint.every=0", "parallel.param_dtype=float32"]
STRATEGIES = ["ddp", "zero2", "zero3", "hybrid_zero2", "hybrid_zero3"]
LAYOUTS = {
    **{s: dict(nproc=None, overrides=[f"parallel.strategy={s}"]) for s in STRATEGIES},
    "foreach": dict(nproc=None, overrides=["optim.implementation=foreach"]),
    "fp16": dict(nproc=None, overrides=["parallel.param_dtype=float16"]),
    "auto": dict(nproc=None, overrides=["parallel.param_dtype=auto"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(tmp_path_factory, LAYOUTS, *STEPS)


def stdout(run_dir) -> str:
    return (run_dir / "stdout.log").read_text()


BIND = """
import torch
import torch.distributed as dist
from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.env import detect_launcher
from clustertrain.distributed.init import init_distributed

device = init_distributed(ParallelConfig(), detect_launcher())
total = torch.ones(1, device=device)
dist.all_reduce(total)
group = dist.distributed_c10d._get_default_group()
print(device, dist.get_backend(), torch.cuda.current_device(), group.bound_device_id, total.item())
dist.destroy_process_group()
"""


def test_a_rank_binds_its_gpu_and_nccl_to_it():
    result = subprocess.run([sys.executable, "-c", BIND], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # set_device, then NCCL given the rank's device_id (eager, no "guessing device ID" from the rank)
    assert result.stdout.split() == ["cuda:0", "nccl", "0", "cuda:0", "1.0"], result.stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_on_one_gpu(runs, strategy):
    run = runs[strategy]
    assert "1 rank(s) on 1 node(s) via single on cuda" in stdout(run)
    assert "AdamW fused" in stdout(run)  # optim.implementation auto: the CUDA kernel
    first, last = losses(run)[1], losses(run)[6]
    assert last < first, losses(run)
    # one data-parallel rank: no FSDP or DDP wrapper whatever the strategy says, so the same training
    assert losses(run) == pytest.approx(losses(runs["zero3"]), rel=1e-4)


def test_fused_adamw_on_the_gpu_trains_as_foreach(runs):
    assert "AdamW foreach" in stdout(runs["foreach"])
    assert losses(runs["zero3"]) == pytest.approx(losses(runs["foreach"]), rel=1e-4)
    assert grad_norms(runs["zero3"]) == pytest.approx(grad_norms(runs["foreach"]), rel=1e-3)


def test_float16_trains_with_the_sharded_loss_scaler(runs):
    run = runs["fp16"]
    scales = [r["loss_scale"] for r in read_metrics(run / "metrics.jsonl") if "loss_scale" in r]
    assert scales and all(0 < s < float("inf") for s in scales), scales
    # within float16's rounding of the float32 run, and the gradient norm unscaled before it is clipped and
    # logged (scaled, it would be ~65,536 times larger)
    assert losses(run) == pytest.approx(losses(runs["zero3"]), rel=1e-2)
    assert grad_norms(run) == pytest.approx(grad_norms(runs["zero3"]), rel=1e-1)


def test_two_ranks_on_two_gpus_train_over_nccl_as_one_does(runs, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this node has {torch.cuda.device_count()}")
    result = train(tmp_path, *STEPS, "parallel.strategy=zero3", nproc=2)
    assert "2 rank(s) on 1 node(s)" in result.stdout and " on cuda, zero3 (dp_replicate=1, dp_shard=2" in result.stdout
    assert losses(tmp_path) == pytest.approx(losses(runs["zero3"]), rel=1e-4)
    assert grad_norms(tmp_path) == pytest.approx(grad_norms(runs["zero3"]), rel=1e-3)


def test_the_default_dtype_is_bf16_and_memory_is_reported_per_interval(runs):
    import yaml

    run = runs["auto"]
    ran = yaml.safe_load((run / "config.yaml").read_text())["parallel"]["param_dtype"]
    assert ran == ("bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float32")
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "mem_gb" in r]
    assert steps and all(0 < r["mem_gb"] <= r["mem_reserved_gb"] for r in steps), steps
    assert losses(run) == pytest.approx(losses(runs["zero3"]), rel=5e-2)  # bf16 tracks the float32 run


TF32 = """
import torch
from clustertrain.config.schema import ParallelConfig
from clustertrain.distributed.env import detect_launcher
from clustertrain.distributed.init import init_distributed

init_distributed(ParallelConfig(), detect_launcher())
print(torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
"""


def test_float32_matmuls_take_tf32_on_a_gpu():
    result = subprocess.run([sys.executable, "-c", TF32], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["high", "True"], result.stdout
