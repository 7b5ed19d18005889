from __future__ import annotations

import math
import re

import pytest
import torch
import transformers
from torch import nn

from clustertrain.model.estimate import (
    check_memory_floor,
    count_params,
    device_memory,
    flops_per_token,
    measure_cpu_peak,
    model_flops_per_token,
    peak_flops,
    peak_flops_for_name,
    training_memory_floor,
)


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )


def build(config, device: str = "cpu") -> nn.Module:
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config)


# Hand counts. Llama: embed 256*64; per layer q,k,v,o 4*64*64 + MLP 3*64*128 + 2 norms 2*64;
# final norm 64; untied lm_head 256*64.
LLAMA_EMBED = 256 * 64
LLAMA_TOTAL = LLAMA_EMBED + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 + 256 * 64
# GPT-2: wte 256*32 (tied with lm_head), wpe 32*32.
GPT2_WTE, GPT2_WPE = 256 * 32, 32 * 32


def test_count_params_llama_by_hand():
    counts = count_params(build(llama_config()))
    assert counts == {
        "total": LLAMA_TOTAL,
        "trainable": LLAMA_TOTAL,
        "embedding": LLAMA_EMBED,
        "flops_params": LLAMA_TOTAL - LLAMA_EMBED,
        "frozen_flops_params": 0,
    }


@pytest.mark.parametrize("config", [llama_config(), gpt2_config()], ids=["llama", "gpt2"])
def test_count_params_meta_matches_real(config):
    real, meta = build(config), build(config, "meta")
    assert next(meta.parameters()).is_meta
    assert count_params(meta) == count_params(real)


def test_tied_head_counted_once():
    model = build(gpt2_config())
    assert model.lm_head.weight is model.transformer.wte.weight
    counts = count_params(model)
    with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert with_duplicates == counts["total"] + GPT2_WTE
    assert counts["embedding"] == GPT2_WTE + GPT2_WPE
    # The tied head is a real matmul: N = everything but wpe, wte counted once.
    assert counts["flops_params"] == counts["total"] - GPT2_WPE


def test_count_params_dedupes_shared_modules_and_frozen():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(4, 2))
    model[3].requires_grad_(False)
    counts = count_params(model)
    assert counts == {"total": 20 + 10, "trainable": 20, "embedding": 0, "flops_params": 30, "frozen_flops_params": 10}


def test_count_params_on_fsdp2_dtensors(tmp_path):
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = build(gpt2_config())
        expected = count_params(model)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert model.lm_head.weight is model.transformer.wte.weight
        assert count_params(model) == expected
    finally:
        dist.destroy_process_group()


def test_flops_per_token_formula():
    n, layers, heads, head_dim, seq = 1_000_000, 12, 12, 64, 1024
    assert flops_per_token(n, layers, heads, head_dim, seq) == 6 * n + 12 * layers * heads * head_dim * seq


@pytest.mark.parametrize("config", [llama_config(), gpt2_config()], ids=["llama", "gpt2"])
def test_model_flops_per_token_reads_config(config):
    model = build(config, "meta")
    n = count_params(model)["flops_params"]
    layers, heads, hidden = 2, 4, config.hidden_size
    expected = 6 * n + 12 * layers * heads * (hidden // heads) * 128
    assert model_flops_per_token(model, 128) == expected


def test_model_flops_per_token_uses_explicit_head_dim():
    config = llama_config()
    config.head_dim = 32  # decoupled from hidden_size // heads, as in e.g. Gemma
    model = build(config, "meta")
    n = count_params(model)["flops_params"]
    assert model_flops_per_token(model, 16) == 6 * n + 12 * 2 * 4 * 32 * 16


def test_lora_flops_count_no_weight_gradient_for_the_frozen_base():
    import peft

    model = peft.get_peft_model(build(llama_config(), "meta"), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    counts = count_params(model)
    lora = 2 * 2 * (64 * 8 + 8 * 64)  # 2 layers x (q, v) x (A + B)
    assert counts["flops_params"] == LLAMA_TOTAL - LLAMA_EMBED + lora
    assert counts["frozen_flops_params"] == LLAMA_TOTAL - LLAMA_EMBED
    attention = 12 * 2 * 4 * 16 * 128
    # The base costs its forward (2) and its input's gradient (2) per token; only the adapters take 6.
    assert model_flops_per_token(model, 128) == 4 * (LLAMA_TOTAL - LLAMA_EMBED) + 6 * lora + attention


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 80GB HBM3", torch.float32, 494.5e12),
        ("NVIDIA H100 80GB HBM3", torch.float16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.5e12),
        ("NVIDIA H200", torch.bfloat16, 989e12),
        ("NVIDIA GH200 480GB", torch.bfloat16, 989e12),
        ("NVIDIA B200", torch.bfloat16, 2250e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A100-PCIE-40GB", torch.float32, 156e12),
        ("NVIDIA A10G", torch.bfloat16, 70e12),
        ("NVIDIA L40S", torch.bfloat16, 362.05e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
        ("Tesla V100-SXM2-16GB", torch.bfloat16, None),
        ("AMD Instinct MI250X", torch.bfloat16, 191.5e12),
        ("AMD Instinct MI250X / MI250", torch.float32, 47.85e12),
        ("AMD Instinct MI210", torch.bfloat16, 181e12),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4e12),
        ("amd instinct mi325x", torch.bfloat16, 1307.4e12),
        ("NVIDIA H100 80GB HBM3", torch.float64, None),
        ("NVIDIA GeForce GTX 1080", torch.bfloat16, None),
        ("", torch.bfloat16, None),
    ],
)
def test_peak_flops_for_name(name, dtype, expected):
    assert peak_flops_for_name(name, dtype) == expected


def test_measure_cpu_peak_positive_finite_and_cached():
    flops = measure_cpu_peak(torch.float32, seconds=0.02)
    assert math.isfinite(flops) and flops > 0
    assert measure_cpu_peak(torch.float32, seconds=0.02) == flops  # lru_cache hit
    assert peak_flops(torch.device("cpu"), torch.float32) > 0


def test_peak_flops_unknown_device_type_is_none():
    assert peak_flops(torch.device("meta"), torch.bfloat16) is None


def test_memory_floor_counts_weights_activations_and_logits_by_their_sizes():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama_config())
    params = count_params(model)["total"]
    floor = training_memory_floor(model, rows=4, seq_len=128, logits_tokens=512, activation_bytes=2, ranks=2)
    assert floor["weights"][0] == params * 4 / 2
    assert floor["activations"] == (4 * 128 * 64 * 2 * 2, "train.micro_batch_size 4 x data.seq_len 128 x hidden 64 "
                                                          "x 2 blocks x 2 bytes")
    assert floor["logits"][0] == 512 * 256 * 8
    split = training_memory_floor(model, rows=4, seq_len=128, logits_tokens=512, activation_bytes=2, ranks=2,
                                  stages=2, tp=2)
    assert split["activations"][0] == floor["activations"][0] / 4 and split["logits"][0] == floor["logits"][0] / 2


def test_a_step_past_the_devices_memory_is_refused_in_one_line_naming_the_sizes():
    from clustertrain.errors import ConfigError

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama_config())
    cpu = torch.device("cpu")
    host = device_memory(cpu)
    seq_len = host // (4 * 64 * 2 * 4) + 1  # activations alone: one token more than the host holds
    floor = training_memory_floor(model, rows=4, seq_len=seq_len, logits_tokens=4096, activation_bytes=4, ranks=1)
    with pytest.raises(ConfigError) as refused:
        check_memory_floor(floor, cpu, "lower train.micro_batch_size or data.seq_len")
    message = str(refused.value)
    assert "\n" not in message
    assert re.fullmatch(r"one training step needs at least [\d,.]+ GiB on each rank, more than the [\d,.]+ GiB of this "
                        rf"cpu: activations train.micro_batch_size 4 x data.seq_len {seq_len:,} x hidden 64 x 2 blocks "
                        r"x 4 bytes = [\d,.]+ GiB; lower train.micro_batch_size or data.seq_len", message), message
    check_memory_floor(training_memory_floor(model, rows=4, seq_len=128, logits_tokens=512, activation_bytes=4,
                                             ranks=1), cpu, "")


def test_measuring_the_cpu_peak_leaves_the_run_s_random_stream_alone():
    """The CPU peak (for MFU) is measured at every start: on random matrices of its own, or a resumed run's dropout
    masks would differ from an uninterrupted run's."""
    state = torch.get_rng_state()
    assert measure_cpu_peak(torch.float32, seconds=0.013) > 0  # a duration of its own: not a cached result
    assert torch.equal(torch.get_rng_state(), state)
