"""The `hardware:` sections of the cluster presets: the numbers `clustertrain plan` works from."""

from __future__ import annotations

import pytest

from clustertrain.errors import ConfigError
from clustertrain.launch.presets import Hardware, builtin_presets, load_preset

WITH_HARDWARE = [name for name in builtin_presets() if load_preset(name).hardware is not None]


def test_every_gpu_preset_has_hardware_and_generic_has_none():
    assert WITH_HARDWARE == ["a100", "frontier", "h100", "perlmutter"]
    assert load_preset("generic").hardware is None


@pytest.mark.parametrize("name", WITH_HARDWARE)
def test_builtin_hardware_is_complete_positive_and_sourced(name):
    hardware = load_preset(name).hardware
    assert isinstance(hardware, Hardware)
    assert hardware.sources and all(source.strip() for source in hardware.sources)
    assert "bfloat16" in hardware.peak_tflops
    assert all(tflops > 0 for tflops in hardware.peak_tflops.values())
    assert hardware.memory_gb > 0 and hardware.intra_node_gbps > 0 and hardware.inter_node_gbps > 0
    # Node-local links are faster than the network, per device.
    assert hardware.intra_node_gbps > hardware.inter_node_gbps
    assert hardware.device_type == "cuda"


def test_frontier_counts_one_gcd_not_one_mi250x():
    hardware = load_preset("frontier").hardware
    assert hardware.device == "AMD MI250X GCD"
    assert hardware.memory_gb == 64
    assert hardware.peak_tflops == {"bfloat16": 191.5, "float16": 191.5, "float32": 47.85}
    assert hardware.intra_node_gbps == 50
    assert hardware.inter_node_gbps == 12.5  # 4 NICs x 25 GB/s / 8 GCDs


def test_generic_nvidia_presets_are_8_gpu_nodes():
    for name, memory, bf16 in (("h100", 80, 989), ("a100", 80, 312)):
        preset = load_preset(name)
        assert preset.gpus_per_node == 8 and preset.description and preset.sources
        assert preset.partition is None and preset.modules == [] and preset.env == {} and preset.scratch is None
        assert preset.hardware.memory_gb == memory and preset.hardware.peak_tflops["bfloat16"] == bf16


HARDWARE = """
description: mine
hardware:
  device: NVIDIA H100 SXM5 80GB
  {key}: 80
  peak_tflops: {{bfloat16: 989}}
  intra_node_gbps: 450
  inter_node_gbps: 50
  sources: [datasheet]
"""


def test_a_user_preset_with_hardware_loads(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(HARDWARE.format(key="memory_gb"))
    hardware = load_preset(str(path)).hardware
    assert hardware.memory_gb == 80 and hardware.device_type == "cuda" and hardware.peak_tflops == {"bfloat16": 989}


def test_an_unknown_hardware_key_is_refused_by_name(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(HARDWARE.format(key="memory_gib"))
    with pytest.raises(ConfigError) as e:
        load_preset(str(path))
    assert "hardware.memory_gib" in str(e.value)
    assert "hardware.memory_gb" in str(e.value)  # and the key it should have been is missing


@pytest.mark.parametrize(("bad", "where"), [
    ("peak_tflops: {bf16: 989}", "hardware.peak_tflops.bf16"),
    ("peak_tflops: {bfloat16: 0}", "hardware.peak_tflops.bfloat16"),
    ("inter_node_gbps: -1", "hardware.inter_node_gbps"),
    ("device_type: rocm", "hardware.device_type"),
    ("sources: []", "hardware.sources"),
])
def test_bad_hardware_values_are_refused_by_name(tmp_path, bad, where):
    key = bad.split(":")[0]
    lines = [line for line in HARDWARE.format(key="memory_gb").splitlines() if not line.strip().startswith(key)]
    path = tmp_path / "mine.yaml"
    path.write_text("\n".join([*lines, f"  {bad}"]) + "\n")
    with pytest.raises(ConfigError) as e:
        load_preset(str(path))
    assert where in str(e.value)
