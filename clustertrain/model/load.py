"""Build a Hugging Face causal LM on the meta device, from a model type and config fields."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from clustertrain.config.remote_code import custom_code
from clustertrain.config.schema import LoraConfig, ModelConfig
from clustertrain.errors import ConfigError
from clustertrain.model.attention import keep_packed_documents_apart


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


def build_hf_config(
    model: ModelConfig, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> PretrainedConfig:
    """The HF config of `model.arch` with the user's fields, sized to the tokenizer's vocabulary (or `vocab_size`).

    For a snapshot (`model.path`, `model.hub_id`) it is the snapshot's config, with any model.config keys the
    user set on top.
    """
    snapshot = snapshot_dir(model)
    if snapshot is not None:
        if problem := custom_code(snapshot):
            raise ConfigError(problem)
        config = AutoConfig.from_pretrained(snapshot, local_files_only=True, trust_remote_code=False,
                                            **model.config_fields)
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
        return AutoConfig.for_model(model.arch, **fields)
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
