"""The model's accounting: parameter counts, training FLOPs per token, peak FLOP/s per device (from the hardware
catalogue, `clustertrain/hardware.py`, for GPUs; measured for the CPU).

MFU (model FLOPs utilization, PaLM appendix B) is

    mfu = flops_per_token * tokens_per_second / (peak_flops * n_devices)

where ``flops_per_token`` counts the matmul FLOPs of one forward + backward pass of one
token (no activation-recompute FLOPs, which is what makes it *model* FLOPs) and
``peak_flops`` is the vendor's dense (no 2:4 sparsity) peak of one torch device.
On a CPU there is no meaningful datasheet number, so the peak is *measured* with a
dense matmul benchmark (:func:`measure_cpu_peak`); a CPU MFU is therefore relative to
what this process can achieve on this machine, not to a theoretical peak.
"""

from __future__ import annotations

import functools
import os
import time

import torch
from torch import nn

from clustertrain.hardware import find

# Substrings of module names that mark a learned position-embedding table
# (OPT "embed_positions", BERT "position_embeddings", GPT-2/nanoGPT "wpe").
_POSITION_NAME_HINTS = ("pos", "position", "wpe")


def _input_embedding_params(model: nn.Module) -> dict[int, nn.Parameter]:
    """Parameters of the input token embedding and any learned position-embedding tables, by id."""
    found: dict[int, nn.Parameter] = {}
    get_input = getattr(model, "get_input_embeddings", None)
    if callable(get_input):
        try:
            emb = get_input()
        except NotImplementedError:
            emb = None
        if emb is not None:
            for p in emb.parameters():
                found[id(p)] = p
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and any(h in leaf for h in _POSITION_NAME_HINTS):
            for p in module.parameters():
                found[id(p)] = p
    return found


def count_params(model: nn.Module) -> dict[str, int]:
    """Counts a model's parameters, each shared (tied) tensor once.

    Works on meta-device models and on FSDP2-sharded models: ``DTensor.numel()`` is the
    global (unsharded) size, so every rank gets the same full-model numbers.

    Args:
        model: Any module; Hugging Face models get their embeddings found via
            ``get_input_embeddings``/``get_output_embeddings``.

    Returns:
        ``total``: all unique parameters. ``trainable``: those with ``requires_grad``.
        ``embedding``: input token + learned position-embedding tables.
        ``flops_params``: parameters that cost matmul FLOPs per token (nanoGPT's N):
        ``total - embedding``, plus the lm_head size when the head is tied to the input
        embedding (the lookup is free, but the tied output projection is a real matmul).
        ``frozen_flops_params``: the part of ``flops_params`` that takes no gradient (LoRA's base).
    """
    unique: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        unique.setdefault(id(p), p)
    total = sum(p.numel() for p in unique.values())
    trainable = sum(p.numel() for p in unique.values() if p.requires_grad)
    emb = _input_embedding_params(model)
    embedding = sum(p.numel() for p in emb.values())
    matmul = [p for key, p in unique.items() if key not in emb]
    get_output = getattr(model, "get_output_embeddings", None)
    head_weight = getattr(get_output() if callable(get_output) else None, "weight", None)
    if head_weight is not None and id(head_weight) in emb:  # tied lm_head
        matmul.append(head_weight)
    flops_params = sum(p.numel() for p in matmul)
    frozen_flops_params = sum(p.numel() for p in matmul if not p.requires_grad)
    return {
        "total": total,
        "trainable": trainable,
        "embedding": embedding,
        "flops_params": flops_params,
        "frozen_flops_params": frozen_flops_params,
    }


def flops_per_token(flops_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int,
                    frozen_params: int = 0) -> float:
    """Training (forward + backward) FLOPs per token.

    ``6·N + 12·L·H·Q·T`` (PaLM, Chowdhery et al. 2022, appendix B; as in nanoGPT's
    ``estimate_mfu``): each of the N matmul parameters costs 2 FLOPs forward and 4
    backward (2 for the input's gradient, 2 for its own); attention scores and the weighted
    sum of values add ``2·2·H·Q·T`` per layer forward, times 3 for forward + backward.
    Causal masking is not discounted, by convention. A frozen parameter (LoRA's base) takes
    no gradient of its own: it costs 4, so ``6·(N - F) + 4·F`` for F frozen ones.

    Args:
        flops_params: N, from :func:`count_params` (``flops_params``).
        n_layers: L, transformer blocks.
        n_heads: H, query heads.
        head_dim: Q, dimension of one head.
        seq_len: T, tokens per sequence.
        frozen_params: F, those of the N that take no gradient.
    """
    return 6.0 * flops_params - 2.0 * frozen_params + 12.0 * n_layers * n_heads * head_dim * seq_len


def _config_attr(config: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """:func:`flops_per_token` for a Hugging Face causal LM, reading L/H/Q from ``model.config``.

    Raises:
        ValueError: if the config lacks the layer/head/hidden sizes.
    """
    config = model.config
    if callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    n_layers = _config_attr(config, ("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    n_heads = _config_attr(config, ("num_attention_heads", "n_head", "num_heads", "n_heads"))
    hidden = _config_attr(config, ("hidden_size", "n_embd", "d_model", "dim"))
    head_dim = _config_attr(config, ("head_dim",))
    if head_dim is None and hidden is not None and n_heads is not None:
        head_dim = hidden // n_heads
    if n_layers is None or n_heads is None or head_dim is None:
        raise ValueError(
            f"cannot read layers/heads/head_dim from {type(config).__name__}: "
            f"got n_layers={n_layers}, n_heads={n_heads}, head_dim={head_dim}"
        )
    counts = count_params(model)
    return flops_per_token(counts["flops_params"], n_layers, n_heads, head_dim, seq_len, counts["frozen_flops_params"])


def training_memory_floor(model: nn.Module, *, rows: int, seq_len: int, logits_tokens: int, activation_bytes: int,
                          ranks: int, stages: int = 1, tp: int = 1) -> dict[str, tuple[float, str]]:
    """The least memory one rank needs to train ``model`` on micro-batches of ``rows`` x ``seq_len``, by part:
    ``{part: (bytes, the arithmetic that gives them)}``. A lower bound, so a refusal on it is never wrong:

    - weights: every parameter once, in its dtype, spread over all ``ranks`` (gradients and AdamW's two
      moments, 2-3 times more, come on top);
    - activations: each block keeps at least its input, ``rows · seq_len · hidden`` values, for the backward
      pass, even under full activation checkpointing; its intermediates come on top (about 34 bytes per token
      and hidden unit in 16 bits without recomputation: Korthikanti et al. 2022, "Reducing Activation
      Recomputation in Large Transformer Models", eq. 1). A rank holds layers / ``stages`` blocks, split at
      best ``tp`` ways (sequence parallelism);
    - logits: ``logits_tokens`` x vocabulary fp32 values and their gradients (the whole micro-batch under the
      full loss, one chunk under the chunked one), split at best ``tp`` ways.
    """
    config = model.config.get_text_config() if callable(getattr(model.config, "get_text_config", None)) else model.config
    layers = _config_attr(config, ("num_hidden_layers", "n_layer", "num_layers", "n_layers")) or 1
    hidden = _config_attr(config, ("hidden_size", "n_embd", "d_model", "dim")) or 1
    vocab = _config_attr(config, ("vocab_size",)) or 1
    unique = {id(p): p for p in model.parameters()}.values()
    params, weights = sum(p.numel() for p in unique), sum(p.numel() * p.element_size() for p in unique)
    blocks = max(1, layers // stages)
    return {
        "weights": (weights / ranks, f"{params:,} parameters x {weights // max(params, 1)} bytes / {ranks} rank(s)"),
        "activations": (rows * seq_len * hidden * blocks * activation_bytes / tp,
                        f"train.micro_batch_size {rows} x data.seq_len {seq_len:,} x hidden {hidden:,} x {blocks} "
                        f"blocks x {activation_bytes} bytes" + (f" / tp {tp}" if tp > 1 else "")),
        "logits": (logits_tokens * vocab * 4 * 2 / tp,
                   f"{logits_tokens:,} tokens x vocabulary {vocab:,} x 4 bytes x 2 (values and gradients)"
                   + (f" / tp {tp}" if tp > 1 else "")),
    }


def check_training_memory(model: nn.Module, device: torch.device, *, rows: int, seq_len: int, full_logits: bool,
                          chunk_tokens: int, activation_bytes: int, ranks: int, stages: int, tp: int) -> None:
    """Refuse sizes that cannot fit (a huge batch, sequence or vocabulary) before any of them is allocated:
    :func:`check_memory_floor` of the :func:`training_memory_floor` of micro-batches of `rows` x `seq_len`, with
    the logits of the whole micro-batch (`full_logits`) or of one loss chunk of `chunk_tokens`."""
    tokens = rows * seq_len
    floor = training_memory_floor(model, rows=rows, seq_len=seq_len, ranks=ranks, stages=stages, tp=tp,
                                  logits_tokens=tokens if full_logits else min(tokens, chunk_tokens),
                                  activation_bytes=activation_bytes)
    check_memory_floor(floor, device, "lower train.micro_batch_size or data.seq_len"
                       + (", or use train.loss=chunked" if full_logits else "")
                       + ", or use a smaller model or more ranks")


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of a GPU, or of this host for a CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory_floor(floor: dict[str, tuple[float, str]], device: torch.device, hint: str) -> None:
    """Refuse in one line, before anything is allocated, a run whose :func:`training_memory_floor` exceeds the
    memory of `device` (of the host, for a CPU); `hint` says which setting to lower."""
    need, have = sum(size for size, _ in floor.values()), device_memory(device)
    if not have or need <= have:
        return
    from clustertrain.errors import ConfigError

    parts = [f"{part} {how} = {size / 2**30:,.1f} GiB" for part, (size, how) in
             sorted(floor.items(), key=lambda item: -item[1][0]) if size >= need / 100]
    raise ConfigError(f"one training step needs at least {need / 2**30:,.1f} GiB on each rank, more than the "
                      f"{have / 2**30:,.1f} GiB of this {device.type}: {'; '.join(parts)}; {hint}")


def peak_flops_for_name(name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of the accelerator called ``name`` for matmuls in ``dtype``, from the hardware
    catalogue (``clustertrain/hardware.py``, where each figure cites its datasheet).

    Args:
        name: A device name as ``torch.cuda.get_device_name`` reports it, e.g.
            ``"NVIDIA H100 80GB HBM3"``; matched case-insensitively by substring.
        dtype: ``bfloat16``, ``float16`` or ``float32`` (float32 means the TF32 rate on
            NVIDIA, which assumes TF32 matmuls are allowed).

    Returns:
        FLOP/s, or None for an unknown device or a dtype the catalogue has no number for.
    """
    device = find(name)
    return device.peak_flops(str(dtype).removeprefix("torch.")) if device else None


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one device: the datasheet table for GPUs, a measurement for the CPU.

    Returns:
        FLOP/s, or None for an unknown GPU or a device type without a number (e.g. MPS).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return measure_cpu_peak(dtype)
    if device.type == "cuda":  # ROCm builds report AMD GPUs as "cuda" too
        return peak_flops_for_name(torch.cuda.get_device_name(device), dtype)
    return None


def measure_cpu_peak(dtype: torch.dtype = torch.float32, seconds: float = 0.25) -> float:
    """Measured achievable dense matmul FLOP/s of this process on the CPU.

    Times repeated square matmuls for about ``seconds`` after one warm-up call. The result
    is cached per ``(dtype, torch.get_num_threads(), seconds)``, so a training loop can
    call this every step. CPU MFU is relative to this measured peak, not to a datasheet.
    """
    return _measure_cpu_peak(dtype, torch.get_num_threads(), seconds)


@functools.lru_cache(maxsize=None)
def _measure_cpu_peak(dtype: torch.dtype, num_threads: int, seconds: float) -> float:
    del num_threads  # only part of the cache key: the measurement uses the current setting
    # 1024 keeps fp32 matmuls compute-bound; low-precision CPU kernels can be far slower
    # (no AMX/AVX512-BF16), so they get 512 to keep one call short.
    n = 1024 if dtype in (torch.float32, torch.float64) else 512
    own = torch.Generator().manual_seed(0)  # never the run's: a measurement must not move its dropout masks
    with torch.no_grad():
        a = torch.randn(n, n, dtype=torch.float32, generator=own).to(dtype)
        b = torch.randn(n, n, dtype=torch.float32, generator=own).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        torch.matmul(a, b, out=out)  # warm-up: thread pool start, kernel selection
        best = float("inf")
        deadline = time.perf_counter() + seconds
        while best == float("inf") or time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.matmul(a, b, out=out)
            best = min(best, time.perf_counter() - start)
    # The fastest call is the achievable peak; slower ones measured a busy machine, not the CPU.
    return 2.0 * n**3 / best
