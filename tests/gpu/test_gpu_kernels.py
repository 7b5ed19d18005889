"""Kernels that only run on a GPU: Liger's (each skipped with its reason where not installed), and inductor's
compile of checkpointed LoRA blocks and of the chunked loss, both training as PyTorch's eager kernels do."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import grad_norms, losses, train

FP32 = ["parallel.param_dtype=float32", "train.steps=6", "checkpoint.every=0"]


def test_liger_kernels_train_as_pytorch_kernels_do(tmp_path):
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (pip install liger-kernel): its kernels are not checked")
    common = [*FP32, "train.loss=chunked"]  # the chunked loss is what Liger's fused loss replaces
    liger = train(tmp_path / "liger", *common, "model.kernels=liger")
    pytorch = train(tmp_path / "pytorch", *common, "model.kernels=none")
    assert "fused loss" in liger.stdout and "using PyTorch kernels" not in liger.stdout + liger.stderr
    assert "chunked loss" in pytorch.stdout
    assert losses(tmp_path / "liger") == pytest.approx(losses(tmp_path / "pytorch"), rel=1e-3)
    assert grad_norms(tmp_path / "liger") == pytest.approx(grad_norms(tmp_path / "pytorch"), rel=1e-2)


# every block checkpointed and LoRA-adapted, the loss chunked (100 tokens do not divide a micro-batch's 256)
COMPILED = [*FP32, "parallel.activation_checkpoint=full", "lora.rank=8", "lora.alpha=16", "lora.dropout=0",
            "train.loss=chunked", "train.loss_chunk_tokens=100", "model.kernels=none", "train.sample_tokens=0"]


def test_inductor_compiles_checkpointed_lora_blocks_and_the_chunked_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a fresh cache: everything compiles
    monkeypatch.setenv("TORCH_LOGS", "graph_breaks")
    compiled = train(tmp_path / "compiled", *COMPILED, "parallel.compile=true")
    assert "Graph break" not in compiled.stdout + compiled.stderr, compiled.stderr[-5000:]
    kernels = list((tmp_path / "inductor").rglob("*.py"))
    assert any("triton" in path.read_text(errors="replace") for path in kernels), "inductor generated no GPU kernels"
    eager = train(tmp_path / "eager", *COMPILED)
    assert "chunked loss" in compiled.stdout and "chunked loss" in eager.stdout
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=5e-3)
    assert grad_norms(tmp_path / "compiled") == pytest.approx(grad_norms(tmp_path / "eager"), rel=5e-2)
