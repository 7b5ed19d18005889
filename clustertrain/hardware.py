"""The hardware catalogue: what clustertrain knows of each accelerator, in one place.

Per device (one torch device, which is one rank: an MI250X GCD, not the MI250X): the names torch gives it, its
memory, its dense peak FLOP/s per dtype, whether it computes bf16 natively, and the fraction of that peak a
training step's matmuls are expected to reach. MFU (`model.estimate`), the cluster presets (`launch.presets`,
whose `hardware.device` names a key of this catalogue) and the planner (`plan.target`) all read it; links
between devices are a property of a cluster's network and stay in its preset.

    find("NVIDIA H100 80GB HBM3").peak_flops("bfloat16")      # 989e12, the name torch.cuda.get_device_name gives
    CATALOGUE_BY_KEY["mi250x-gcd"].memory_gb                  # 64, what a preset names
    param_dtype_for("auto", "cuda", "Tesla V100-SXM2-16GB")   # "float32": no bf16 tensor cores
"""

from __future__ import annotations

from dataclasses import dataclass

# The fraction of the peak FLOP/s a training step is expected to reach: the published MFU of comparable runs per
# device family (docs/plan.md tabulates them). MFU counts the model's FLOPs only, and the plan adds recompute and
# unhidden communication on top, so these err slow.
# Hopper (H100; H200 and GH200 carry the same GPU): 0.40. "The Llama 3 Herd of Models" (Meta, arXiv:2407.21783),
# Table 4: 38-43% BF16 MFU, Llama 3 405B on 8,192-16,384 H100s; llm-foundry's H100 80GB BF16 table
# (github.com/mosaicml/llm-foundry, scripts/train/benchmarking/README.md): MPT-7B to 70B, 2k-8k tokens, 8-64 GPUs,
# 36-46%; torchtitan's docs/performance.md: Llama 3.1 8B on 8 and 128 H100s (500 W), 33-39%.
HOPPER_EFFICIENCY = 0.40
# A100 80GB: 0.55. torchtitan's docs/performance.md: Llama 3 8B on 64 A100 80GB, FSDP2, 56.8% (selective layer)
# and 58.2% (selective op) MFU, 70B 51.7%; llm-foundry's A100 80GB table: MPT-7B and 13B, 2k-8k tokens, 54-64%.
A100_80GB_EFFICIENCY = 0.55
# A100 40GB: 0.50. llm-foundry's A100 40GB table: MPT-7B and 13B, 2k-8k tokens, 8-128 GPUs, 44-53%.
A100_40GB_EFFICIENCY = 0.50
# CDNA2 (an MI250X GCD; the MI250's is the same die, clocked lower): 0.40. Llama 3 8B with torchtitan on 64
# Frontier GCDs, FSDP2, op-level selective checkpointing: ~40% MFU (github.com/eminorhan/frontier-torchtitan,
# README); Dash et al., "Optimizing Distributed Training on Frontier for Large Language Models" (arXiv:2312.12705,
# 2023): 38.38%, 36.14% and 31.96% of peak for 22B, 175B and 1T GPT models on MI250X.
CDNA2_EFFICIENCY = 0.40
# Every other device (and a preset's own): NO PUBLISHED FIGURE, an unsourced default until one is measured
# (docs/plan.md: one H100's step times planned at 0.5 were 0.65 and 0.50 of the measured ones).
EFFICIENCY = 0.5
DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Accelerator:
    """One torch device of the catalogue (or of a user's preset); FLOP/s are dense, without 2:4 sparsity."""

    key: str  # what a preset's `hardware.device` names, e.g. "h100-sxm"
    name: str  # what it is, e.g. "NVIDIA H100 SXM5 80GB"
    patterns: tuple[str, ...]  # case-insensitive substrings of torch.cuda.get_device_name() that mean this device
    memory_gb: float | None  # decimal GB (10^9 bytes) as the vendor states it; None: the name does not say
    bf16: float | None  # None: no bf16 tensor/matrix cores (bf16 is emulated, or not there)
    fp32: float | None  # TF32 tensor cores on NVIDIA (Ampere+), FP32 matrix cores on AMD
    fp16: float | None = None  # None: same as bf16
    efficiency: float = EFFICIENCY
    device_type: str = "cuda"  # torch's device type: "cuda" on NVIDIA and on ROCm builds alike

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matmuls run on the device's own tensor/matrix cores (not emulated)."""
        return self.bf16 is not None

    def peak_flops(self, dtype: str) -> float | None:
        """Dense peak FLOP/s for matmuls in `dtype` ("bfloat16", "float16", "float32"); None where unknown."""
        if dtype == "float16":
            return self.fp16 if self.fp16 is not None else self.bf16
        return {"bfloat16": self.bf16, "float32": self.fp32}.get(dtype)


# Dense peak FLOP/s of ONE torch device, no 2:4 sparsity (datasheets print sparse numbers with an asterisk;
# these are half of those). find() takes the first match, so more specific names come first: "GH200" contains
# "H200", "GB200" contains "B200", "L40S" contains "L4".
CATALOGUE: tuple[Accelerator, ...] = (
    # NVIDIA H100 datasheet: H100 NVL BF16 1,671* / TF32 835* TFLOPS (per GPU), 94 GB HBM3.
    Accelerator("h100-nvl", "NVIDIA H100 NVL", ("h100 nvl",), 94, 835.5e12, 417.5e12, efficiency=HOPPER_EFFICIENCY),
    # NVIDIA H100 datasheet: H100 PCIe BF16 1,513* / TF32 756* TFLOPS, 80 GB HBM2e.
    Accelerator("h100-pcie", "NVIDIA H100 PCIe", ("h100 pcie",), 80, 756e12, 378e12, efficiency=HOPPER_EFFICIENCY),
    # NVIDIA GH200 datasheet: same Hopper GPU as H100 SXM, BF16 1,979* / TF32 989*; 96 GB HBM3 ("GH200 480GB").
    Accelerator("gh200", "NVIDIA GH200", ("gh200",), 96, 989e12, 494.5e12, efficiency=HOPPER_EFFICIENCY),
    # NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/): H100 SXM BF16 1,979* / TF32 989*
    # ("NVIDIA H100 80GB HBM3"), 80 GB HBM3; torch float32 matmuls run at the TF32 rate with TF32 enabled.
    Accelerator("h100-sxm", "NVIDIA H100 SXM5 80GB", ("h100",), 80, 989e12, 494.5e12, efficiency=HOPPER_EFFICIENCY),
    # NVIDIA H200 datasheet: H200 NVL BF16 1,671* / TF32 835*, 141 GB HBM3e.
    Accelerator("h200-nvl", "NVIDIA H200 NVL", ("h200 nvl",), 141, 835.5e12, 417.5e12, efficiency=HOPPER_EFFICIENCY),
    # NVIDIA H200 datasheet: H200 SXM BF16 1,979* / TF32 989*, 141 GB HBM3e.
    Accelerator("h200-sxm", "NVIDIA H200 SXM", ("h200",), 141, 989e12, 494.5e12, efficiency=HOPPER_EFFICIENCY),
    # NVIDIA GB200 NVL72 datasheet: 360 PF BF16* / 180 PF TF32* and 13.4 TB HBM3e for 72 GPUs.
    Accelerator("gb200", "NVIDIA GB200", ("gb200",), 186, 2500e12, 1250e12),
    # NVIDIA HGX B200 datasheet: 36 PF BF16* / 18 PF TF32* and 1.4 TB HBM3e for 8 GPUs.
    Accelerator("b200", "NVIDIA B200", ("b200",), 180, 2250e12, 1125e12),
    # NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/), SXM and PCIe: BF16 312 / TF32 156
    # dense; 80 GB HBM2e or 40 GB HBM2. torch names
    # the 80 GB ones "NVIDIA A100-SXM4-80GB" and "NVIDIA A100 80GB PCIe"; any other A100 counts as a 40 GB one.
    Accelerator("a100-80gb", "NVIDIA A100 SXM4 80GB", ("a100-sxm4-80gb", "a100 80gb"), 80, 312e12, 156e12,
                efficiency=A100_80GB_EFFICIENCY),
    Accelerator("a100-40gb", "NVIDIA A100 SXM4 40GB", ("a100",), 40, 312e12, 156e12, efficiency=A100_40GB_EFFICIENCY),
    # NVIDIA publishes no A10G datasheet; AWS EC2 G5 figures: 70 TFLOPS FP16 tensor, 35 TF32, 24 GB.
    Accelerator("a10g", "NVIDIA A10G", ("a10g",), 24, 70e12, 35e12),
    # NVIDIA A10 datasheet: BF16 125 / TF32 62.5 dense, 24 GB GDDR6 (after "a100"/"a10g": substring).
    Accelerator("a10", "NVIDIA A10", ("a10",), 24, 125e12, 62.5e12),
    # NVIDIA L40S datasheet: BF16 362.05 / TF32 183 dense, 48 GB GDDR6.
    Accelerator("l40s", "NVIDIA L40S", ("l40s",), 48, 362.05e12, 183e12),
    # NVIDIA L40 datasheet: BF16 181.05 / TF32 90.5 dense, 48 GB GDDR6.
    Accelerator("l40", "NVIDIA L40", ("l40",), 48, 181.05e12, 90.5e12),
    # NVIDIA L4 datasheet: BF16 242* / TF32 120* TFLOPS, 24 GB GDDR6.
    Accelerator("l4", "NVIDIA L4", ("l4",), 24, 121e12, 60e12),
    # NVIDIA V100 datasheet: FP16 tensor / FP32 TFLOPS, SXM2 125 / 15.7, PCIe 112 / 14, V100S 130 / 16.4;
    # 16 or 32 GB HBM2 (V100S: 32). No BF16 tensor cores (and no TF32), so no bf16 peak.
    Accelerator("v100s", "NVIDIA V100S", ("v100s",), 32, None, 16.4e12, fp16=130e12),
    Accelerator("v100-pcie", "NVIDIA V100 PCIe", ("v100-pcie",), None, None, 14e12, fp16=112e12),
    Accelerator("v100-sxm2", "NVIDIA V100 SXM2", ("v100",), None, None, 15.7e12, fp16=125e12),
    # AMD MI250X datasheet (https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html): BF16 (and
    # FP16) 383 / FP32 matrix 95.7 TFLOPS and 128 GB HBM2e for 2 GCDs, no sparsity figure; one GCD is one
    # torch device. ROCm may report "AMD Instinct MI250X / MI250": matched as MI250X.
    Accelerator("mi250x-gcd", "AMD MI250X GCD", ("mi250x",), 64, 191.5e12, 47.85e12, efficiency=CDNA2_EFFICIENCY),
    # AMD MI250 datasheet: BF16 362.1 / FP32 matrix 90.5 TFLOPS and 128 GB HBM2e for 2 GCDs.
    Accelerator("mi250-gcd", "AMD MI250 GCD", ("mi250",), 64, 181.05e12, 45.25e12, efficiency=CDNA2_EFFICIENCY),
    # AMD MI210 datasheet: BF16 181 / FP32 matrix 45.3 TFLOPS (one GCD), 64 GB HBM2e.
    Accelerator("mi210", "AMD MI210", ("mi210",), 64, 181e12, 45.3e12),
    # AMD MI300X datasheet: BF16 1,307.4 / FP32 matrix 163.4 TFLOPS dense, 192 GB HBM3.
    Accelerator("mi300x", "AMD MI300X", ("mi300x",), 192, 1307.4e12, 163.4e12),
    # AMD MI300A datasheet: BF16 980.6 / FP32 matrix 122.6 TFLOPS dense, 128 GB HBM3 (shared with its CPU).
    Accelerator("mi300a", "AMD MI300A", ("mi300a",), 128, 980.6e12, 122.6e12),
    # AMD MI325X datasheet: BF16 1,307.4 / FP32 matrix 163.4 TFLOPS dense, 256 GB HBM3E.
    Accelerator("mi325x", "AMD MI325X", ("mi325x",), 256, 1307.4e12, 163.4e12),
)
CATALOGUE_BY_KEY = {device.key: device for device in CATALOGUE}


def find(name: str) -> Accelerator | None:
    """The catalogue's device called `name` as torch.cuda.get_device_name reports it (e.g. "NVIDIA H100 80GB
    HBM3", matched case-insensitively by substring); None for a device it does not know."""
    lowered = name.lower()
    return next((device for device in CATALOGUE if any(p in lowered for p in device.patterns)), None)


def param_dtype_for(requested: str, device_type: str, device: str | Accelerator | None = None) -> str:
    """`parallel.param_dtype` as it runs on a device: "auto" is bfloat16 where the device computes bf16 natively,
    float32 elsewhere (a V100, whose bf16 is emulated; the CPU, where bf16 matmuls are slow); others as given.

    Args:
        requested: the config's `parallel.param_dtype`.
        device_type: torch's device type ("cuda" on ROCm too).
        device: a GPU by name (looked up in the catalogue; one it does not know gets float32) or as an
            Accelerator (a preset's); None: this process's own GPU, which torch is asked about.
    """
    if requested != "auto":
        return requested
    if device_type != "cuda":
        native = False
    elif device is None:
        import torch  # here, not above: the presets read this catalogue in job steps that must start fast

        native = torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        known = find(device) if isinstance(device, str) else device
        native = known is not None and known.native_bf16
    return "bfloat16" if native else "float32"
