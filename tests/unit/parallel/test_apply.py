"""parallel.param_dtype: auto resolves to what the rank's device runs fast."""

from __future__ import annotations

import pytest
import torch

from clustertrain.config.schema import ParallelConfig
from clustertrain.parallel.apply import resolve_param_dtype


@pytest.mark.parametrize(("device_type", "native_bf16", "expected"), [
    ("cuda", True, "bfloat16"),  # A100, H100, MI250X: bf16 tensor cores
    ("cuda", False, "float32"),  # V100: bf16 only emulated (and float32 matmuls take TF32 where it exists)
    ("cpu", True, "float32"),  # bf16 matmuls are slow on most CPUs
])
def test_auto_is_bfloat16_on_a_gpu_with_bf16_tensor_cores(monkeypatch, device_type, native_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16)
    assert ParallelConfig().param_dtype == "auto"
    assert resolve_param_dtype("auto", device_type) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept_on_any_device(dtype):
    assert resolve_param_dtype(dtype, "cuda") == dtype
    assert resolve_param_dtype(dtype, "cpu") == dtype
