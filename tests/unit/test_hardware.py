"""The hardware catalogue: the one param-dtype rule, and the presets and MFU reading the same numbers."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY

from clustertrain.config.schema import ParallelConfig
from clustertrain.hardware import CATALOGUE, CATALOGUE_BY_KEY, DTYPE_NAMES, find, param_dtype_for
from clustertrain.launch.presets import load_preset
from clustertrain.model.estimate import peak_flops_for_name
from clustertrain.plan.target import TargetRequest, target_for
from clustertrain.resolve.load import load_checked_config


@pytest.mark.parametrize(("device_type", "native_bf16", "expected"), [
    ("cuda", True, "bfloat16"),  # A100, H100, MI250X: bf16 tensor cores
    ("cuda", False, "float32"),  # V100: bf16 only emulated (and float32 matmuls take TF32 where it exists)
    ("cpu", True, "float32"),  # bf16 matmuls are slow on most CPUs
])
def test_auto_is_bfloat16_on_a_gpu_with_bf16_tensor_cores(monkeypatch, device_type, native_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16)
    assert ParallelConfig().param_dtype == "auto"
    assert param_dtype_for("auto", device_type) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept_on_any_device(dtype):
    assert param_dtype_for(dtype, "cuda") == dtype
    assert param_dtype_for(dtype, "cpu") == dtype


V100_PRESET = """
gpus_per_node: 8
hardware:
  device: v100-sxm2
  memory_gb: 32
  intra_node_gbps: 150
  inter_node_gbps: 12.5
  sources: [a test]
"""


@pytest.mark.parametrize(("name", "preset", "expected"), [
    ("Tesla V100-SXM2-32GB", "v100", "float32"),  # bf16 emulated: no bf16 tensor cores
    ("NVIDIA H100 80GB HBM3", "h100", "bfloat16"),
    ("AMD Instinct MI250X / MI250", "frontier", "bfloat16"),
    (None, "generic", "float32"),  # the CPU
], ids=["v100", "h100", "mi250x", "cpu"])
def test_param_dtype_auto_agrees_from_a_name_and_from_a_preset(tmp_path, name, preset, expected):
    if preset == "v100":
        (tmp_path / "v100.yaml").write_text(V100_PRESET)
        preset = str(tmp_path / "v100.yaml")
    hardware = load_preset(preset).hardware
    assert param_dtype_for("auto", "cuda" if name else "cpu", name) == expected
    config = load_checked_config(None, TINY)
    assert config.parallel.param_dtype == "auto"
    planned = target_for(config, TargetRequest(world=8, peak_tflops=1.0), hardware)
    assert planned.config.parallel.param_dtype == expected
    if hardware is not None:  # the preset's device is the one torch names so, and its own numbers say alike
        assert find(name).name == hardware.device
        assert param_dtype_for("auto", "cuda", hardware.accelerator) == expected


@pytest.mark.parametrize(("preset", "key", "torch_name"), [
    ("frontier", "mi250x-gcd", "AMD Instinct MI250X"), ("h100", "h100-sxm", "NVIDIA H100 80GB HBM3"),
    ("a100", "a100-80gb", "NVIDIA A100-SXM4-80GB"), ("perlmutter", "a100-40gb", "NVIDIA A100-SXM4-40GB"),
])
def test_a_preset_and_mfu_read_one_catalogue(preset, key, torch_name):
    hardware, known = load_preset(preset).hardware, CATALOGUE_BY_KEY[key]
    assert find(torch_name) is known
    assert (hardware.device, hardware.memory_gb, hardware.efficiency) == (known.name, known.memory_gb, known.efficiency)
    for dtype in DTYPE_NAMES:
        assert hardware.peak_tflops[dtype] * 1e12 == known.peak_flops(dtype)
        assert peak_flops_for_name(torch_name, getattr(torch, dtype)) == known.peak_flops(dtype)
    assert hardware.sources[0].endswith(key)


def test_the_catalogue_has_one_entry_per_key_each_found_by_its_own_name():
    assert len(CATALOGUE_BY_KEY) == len(CATALOGUE)
    for device in CATALOGUE:  # first match wins: no earlier, shorter pattern may shadow a device
        assert all(find(pattern) is device for pattern in device.patterns), device.key
        assert 0 < device.efficiency <= 1 and (device.bf16 or device.fp16) and device.fp32


@pytest.mark.parametrize(("preset", "published"), [
    ("h100", 0.40),  # Llama 3 405B on 16K H100s: 38-43% MFU; llm-foundry and torchtitan tables
    ("a100", 0.55),  # torchtitan's Llama 3 8B on 64 A100 80GB: 57-58%; llm-foundry: 54-64%
    ("perlmutter", 0.50),  # llm-foundry's A100 40GB table: 44-53%
    ("frontier", 0.40),  # torchtitan's Llama 3 8B on 64 MI250X GCDs: ~40%; Dash et al. 2023: 32-38%
], ids=["h100", "a100", "perlmutter", "frontier"])
def test_a_plan_runs_at_its_device_s_published_efficiency_unless_told_another(capsys, preset, published):
    from clustertrain.cli import main

    plans = {}
    for told in (None, 0.2):
        argv = ["plan", "--world", "2", "--preset", preset, "--json", *[f"--set={o}" for o in TINY]]
        main([*argv, *(["--efficiency", str(told)] if told else [])])
        plans[told] = json.loads(capsys.readouterr().out)
    assert plans[None]["device"]["efficiency"] == published and plans[0.2]["device"]["efficiency"] == 0.2
    assert plans[0.2]["compute_s"] == pytest.approx(plans[None]["compute_s"] * published / 0.2, rel=1e-9)
