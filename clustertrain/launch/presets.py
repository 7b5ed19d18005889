"""Cluster presets: what a site needs in every job script (modules, network variables, GPUs per node, scratch).

The built-in presets are YAML files beside this module; a user's own preset is a file of the same form,
named by path in `slurm.preset`. Each preset lists the documents its values come from. A preset may also
describe its accelerators (`hardware:`), for `clustertrain plan`: the device, a key of the hardware catalogue
(`clustertrain/hardware.py`, which holds its memory and peak TFLOPS), and the cluster's interconnect bandwidths,
which are the preset's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from clustertrain.config.load import load_yaml, read_utf8
from clustertrain.config.slurm_schema import MAX_PER_NODE
from clustertrain.errors import ConfigError, one_line
from clustertrain.hardware import CATALOGUE_BY_KEY, DTYPE_NAMES, EFFICIENCY, Accelerator

PRESET_DIR = Path(__file__).parent / "presets"


class Hardware(BaseModel):
    """One accelerator of the cluster's nodes: one torch device, which is one rank (an MI250X GCD, not the MI250X).

    `device` names a key of the hardware catalogue (`clustertrain/hardware.py`), which fills in what the device
    is, its memory and its peaks; a device the catalogue lacks gives them here. Vendors' peak figures, not
    measurements: a planner scales them by the expected `efficiency`.
    """

    model_config = ConfigDict(extra="forbid")

    device: str = Field(
        min_length=1, description='A catalogue key, e.g. "mi250x-gcd" or "h100-sxm" (then "AMD MI250X GCD", "NVIDIA '
        'H100 SXM5 80GB"), or what one device the catalogue lacks is.'
    )
    device_type: Literal["cuda", "cpu"] = Field(
        "cuda", description='torch\'s device type for it ("cuda" on NVIDIA and on ROCm builds alike).'
    )
    memory_gb: float = Field(gt=0, description="Device memory in decimal GB (10^9 bytes), as the vendor states it.")
    peak_tflops: dict[Literal["bfloat16", "float16", "float32"], Annotated[float, Field(gt=0)]] = Field(
        min_length=1,
        description="Dense peak TFLOPS per device by torch dtype name, without sparsity; float32 is the "
        "matrix/tensor-core figure (TF32 on NVIDIA) where the device has one.",
    )
    intra_node_gbps: float = Field(
        gt=0, description="GB/s per direction one device can send to the other devices of its node in a ring "
        "collective (its slowest link in the ring).",
    )
    inter_node_gbps: float = Field(
        gt=0, description="GB/s per direction per device across nodes: the node's injection bandwidth divided by "
        "its devices.",
    )
    efficiency: float = Field(EFFICIENCY, gt=0, le=1, description="The fraction of the peak FLOP/s a step's "
                              "matmuls are expected to reach.")
    sources: list[str] = Field(min_length=1, description="URLs or document names the numbers come from (for a "
                               "catalogue device, the catalogue first).")

    @model_validator(mode="before")
    @classmethod
    def _from_catalogue(cls, data: object) -> object:
        """A catalogue key as `device`: its name, memory and peaks, with the catalogue as a source; numbers given
        here win."""
        device = data.get("device") if isinstance(data, dict) else None
        known = CATALOGUE_BY_KEY.get(device) if isinstance(device, str) else None
        if known is None:
            return data
        peaks = {dtype: known.peak_flops(dtype) / 1e12 for dtype in DTYPE_NAMES if known.peak_flops(dtype)}
        filled = {"device_type": known.device_type, "memory_gb": known.memory_gb, "peak_tflops": peaks,
                  "efficiency": known.efficiency}
        sources = data.get("sources", [])  # not a list: left for the field to refuse
        if isinstance(sources, list):
            sources = [f"the hardware catalogue, clustertrain/hardware.py: {known.key}", *sources]
        return {**{k: v for k, v in filled.items() if v is not None}, **data, "device": known.name, "sources": sources}

    @property
    def accelerator(self) -> Accelerator:
        """This device as the catalogue describes devices, with this preset's numbers."""
        peak = {dtype: self.peak_tflops[dtype] * 1e12 if dtype in self.peak_tflops else None for dtype in DTYPE_NAMES}
        return Accelerator(self.device, self.device, (), self.memory_gb, peak["bfloat16"], peak["float32"],
                           peak["float16"], self.efficiency, self.device_type)


class Preset(BaseModel):
    """A cluster's defaults; `slurm.*` keys in the run config override or extend them."""

    model_config = ConfigDict(extra="forbid")

    description: str = ""
    cluster_names: list[str] = Field(
        default_factory=list, description="Slurm's names of the cluster (SLURM_CLUSTER_NAME): a rank there started "
        "by hand (srun, torchrun, mpirun) warns of each variable of `env` missing from its environment, and "
        "`clustertrain doctor` fails on it.",
    )
    sources: list[str] = Field(default_factory=list, description="Where the values come from.")
    partition: str | None = None
    qos: str | None = None
    gpus_per_node: int = Field(0, ge=0, le=MAX_PER_NODE)
    cpus_per_task: int | None = Field(
        None, gt=0, description="CPU cores per rank; unset: cores_per_node / ranks per node (1 on GPU nodes)."
    )
    cores_per_node: int | None = Field(
        None, gt=0, description="Usable cores per node; unset on CPU-only nodes: the job takes whole nodes "
        "(--exclusive) and counts them at run time (SLURM_CPUS_ON_NODE)."
    )
    sbatch: dict[str, str | int | bool] = Field(default_factory=dict)
    srun: list[str] = Field(default_factory=list, description="Extra srun options of the training step.")
    modules: list[str] = Field(default_factory=list)
    scratch: str | None = Field(None, description="Root for the HF and clustertrain caches on the nodes.")
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)
    hardware: Hardware | None = Field(
        None, description="The nodes' accelerators, for `clustertrain plan` (job scripts do not use it); "
        "unset: unknown.",
    )


def on_cluster(preset: Preset, environ: Mapping[str, str]) -> bool:
    """Whether this process runs on `preset`'s cluster (its SLURM_CLUSTER_NAME is one of `cluster_names`)."""
    return environ.get("SLURM_CLUSTER_NAME", "").lower() in {name.lower() for name in preset.cluster_names}


def builtin_presets() -> list[str]:
    """Names of the presets that ship with clustertrain."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name_or_path: str) -> Preset:
    """A built-in preset by name, or a preset file by path.

    Raises:
        ConfigError: no such preset, or the file is not a valid preset (the message names the key).
    """
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    path = Path(name_or_path) if looks_like_path else PRESET_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(builtin_presets())
        what = f"preset file {path} does not exist" if looks_like_path else f"no built-in preset {name_or_path!r}"
        raise ConfigError(f"slurm.preset: {what}; use one of {known}, or the path of your own preset YAML")
    try:
        data = load_yaml(read_utf8(path, "slurm.preset: file"), f"slurm.preset: {path}") or {}
        return Preset.model_validate(data)
    except yaml.YAMLError as e:
        raise ConfigError(f"slurm.preset: {path} is not valid YAML: {one_line(e)}") from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"slurm.preset: {path}: {problems}") from None
