"""Build a run's Hugging Face causal LM on the meta device, without a process group:

    built = build_model(cfg.model, cfg.lora, tokenizer, cfg.data.vocab_size, param_dtype=torch.bfloat16,
                        device="cuda", tp=2, pipeline=False, packed_documents=cfg.data.packed_documents)
    apply_loss_head(built.model, ..., fused=built.kernels.linear_cross_entropy)   # clustertrain.model.loss

`build_model` builds exactly what a run builds (a planner calls it on a login node, the trainer on each rank):
the HF config, the attention kernel for the device, the meta model (LoRA-wrapped if asked) and its fused kernels.
The loss head is the trainer's to add: it lives in `clustertrain.model.loss`, a layer above this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from clustertrain.config.remote_code import custom_code
from clustertrain.config.schema import LoraConfig, ModelConfig
from clustertrain.errors import ConfigError
from clustertrain.model.attention import keep_packed_documents_apart, resolve_attention
from clustertrain.model.kernels import apply_kernels
from clustertrain.model.loss import apply_loss_head, resolve_loss


@dataclass
class BuiltModel:
    """What `build_model` built.

    Attributes:
        hf_config: the model's HF config (the snapshot's, or model.arch's with model.config on top).
        model: the causal LM, every parameter on the meta device; peft-wrapped under LoRA; its head computes the
            loss (clustertrain.model.loss).
        attention: the attention kernel it is built with ("sdpa", "flash_attention_2", ...).
        loss: the loss that runs ("full", "chunked" or "fused").
        notes: what the run says at start about its kernels and loss (a fallback and why).
    """

    hf_config: PretrainedConfig
    model: nn.Module
    attention: str
    loss: str
    notes: list[str]


def build_model(model: ModelConfig, lora: LoraConfig | None, tokenizer: PreTrainedTokenizerBase | None,
                vocab_size: int, *, param_dtype: torch.dtype, device: torch.device | str, loss: str,
                loss_chunk_tokens: int, compile: bool = False, tp: int = 1, pipeline: bool = False,
                packed_documents: bool = False) -> BuiltModel:
    """The run's model on the meta device, with its attention kernel, fused kernels and loss head: what a run
    parallelizes and materializes, and what a planner measures.

    Args:
        model, lora: the config's sections.
        tokenizer, vocab_size: size a from-scratch vocabulary (`data.vocab_size` when there is no tokenizer).
        param_dtype: the compute dtype (`parallel.param_dtype`), also the dtype of a LoRA model's frozen base.
        device: where the run computes (only its type matters: "cuda" on ROCm too); no process group is needed.
        loss, loss_chunk_tokens, compile: `train.loss` (auto resolved here), `train.loss_chunk_tokens`,
            `parallel.compile`.
        tp: `parallel.tp`; pipeline: `parallel.pp > 1`; packed_documents: `data.packed_documents`.

    Raises:
        ConfigError: the model, its attention kernel or `model.kernels` cannot run here, in one line.
    """
    device = torch.device(device)
    hf_config = build_hf_config(model, tokenizer, vocab_size)
    attention = resolve_attention(model.attn_implementation, hf_config, device.type, dtype=param_dtype,
                                  pipeline=pipeline, packed_documents=packed_documents)
    meta = build_meta_model(hf_config, lora, param_dtype, attention)
    kernels = apply_kernels(meta, model.kernels, device, tp)
    loss_kind, loss_note = apply_loss_head(meta, resolve_loss(loss, hf_config.vocab_size), loss_chunk_tokens, compile,
                                           fused=kernels.linear_cross_entropy)
    return BuiltModel(hf_config, meta, attention, loss_kind, [note for note in (kernels.note, loss_note) if note])


def snapshot_dir(model: ModelConfig) -> Path | None:
    """The local HF model directory to fine-tune (`model.path`, or `model.hub_id` in the HF cache), or None."""
    if model.hub_id:
        from clustertrain.model.download import resolve_hub_id

        return resolve_hub_id(model.hub_id)
    if not model.path:
        return None
    path = Path(model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    return path


def hf_config_from(model: ModelConfig, snapshot: Path | None, fields: dict[str, Any]) -> PretrainedConfig:
    """The one place a model config becomes an HF config: the snapshot's config.json, or model.arch's defaults,
    with `fields` on top.

    Raises:
        ConfigError: the snapshot ships code of its own. Whatever the HF config class raises for values it
            refuses passes through: `build_hf_config` and the config's checks (`clustertrain.model.spec`) each
            say it their way.
    """
    if snapshot is None:
        return AutoConfig.for_model(model.arch, **fields)
    if problem := custom_code(snapshot):
        raise ConfigError(problem)
    return AutoConfig.from_pretrained(snapshot, local_files_only=True, trust_remote_code=False, **fields)


def build_hf_config(
    model: ModelConfig, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> PretrainedConfig:
    """The HF config of `model.arch` with the user's fields, sized to the tokenizer's vocabulary (or `vocab_size`).

    For a snapshot (`model.path`, `model.hub_id`) it is the snapshot's config, with any model.config keys the
    user set on top.
    """
    snapshot = snapshot_dir(model)
    if snapshot is not None:
        config = hf_config_from(model, snapshot, model.config_fields)
        if tokenizer is not None and len(tokenizer) > config.vocab_size:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but {snapshot} only {config.vocab_size}")
        return config
    fields = dict(model.config_fields)
    needed = len(tokenizer) if tokenizer is not None else vocab_size
    fields.setdefault("vocab_size", needed)
    if fields["vocab_size"] < needed:
        raise ConfigError(f"model.config.vocab_size = {fields['vocab_size']} is smaller than the {needed} tokens needed")
    if tokenizer is not None:
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(tokenizer, name)
            fields.setdefault(name, value if value is not None else tokenizer.eos_token_id)
        # HF embeddings keep the pad row at zero with no gradient: a pad that is the end-of-text token would leave
        # the token between documents unlearned. Padding carries no loss, so no pad id is needed then.
        pad = tokenizer.pad_token_id
        fields.setdefault("pad_token_id", pad if pad is not None and pad != tokenizer.eos_token_id else None)
    try:
        return hf_config_from(model, None, fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model.config: {model.arch} rejects these fields: {e}") from None


def build_meta_model(hf_config: PretrainedConfig, lora: LoraConfig | None = None,
                     base_dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> nn.Module:
    """The model with every parameter on the meta device (no memory until it is materialized), LoRA-wrapped if asked
    (its frozen base in `base_dtype`).

    `attn_implementation` is the kernel `clustertrain.model.attention.resolve_attention` chose for the run's
    device and data; sdpa, the default, suits a model that is only exported, counted or run on CPU.
    """
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=attn_implementation, dtype=torch.float32, trust_remote_code=False
        )
    if attn_implementation == "flash_attention_2":
        keep_packed_documents_apart(built)
    if lora is not None and lora.enabled:
        from clustertrain.lora import apply_lora

        return apply_lora(built, lora, base_dtype)
    return built


def block_classes(model: PreTrainedModel) -> tuple[type[torch.nn.Module], ...]:
    """The transformer block classes (HF's `_no_split_modules`) that sharding and checkpointing wrap."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ConfigError(f"model.arch = {model.config.model_type!r}: no transformer blocks found to wrap")
    return tuple(classes)
