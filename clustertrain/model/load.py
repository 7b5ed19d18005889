"""Build a Hugging Face causal LM on the meta device, from a model type and config fields."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from clustertrain.config.schema import ModelConfig
from clustertrain.errors import ConfigError


def build_hf_config(
    model: ModelConfig, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> PretrainedConfig:
    """The HF config of `model.arch` with the user's fields, sized to the tokenizer's vocabulary (or `vocab_size`)."""
    fields = dict(model.config)
    needed = len(tokenizer) if tokenizer is not None else vocab_size
    fields.setdefault("vocab_size", needed)
    if fields["vocab_size"] < needed:
        raise ConfigError(f"model.config.vocab_size = {fields['vocab_size']} is smaller than the {needed} tokens needed")
    if tokenizer is not None:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, name)
            fields.setdefault(name, value if value is not None else tokenizer.eos_token_id)
    try:
        return AutoConfig.for_model(model.arch, **fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model.config: {model.arch} rejects these fields: {e}") from None


def build_meta_model(model: ModelConfig, hf_config: PretrainedConfig) -> PreTrainedModel:
    """The model with every parameter on the meta device: no memory is allocated until it is materialized."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=model.attn_implementation, dtype=torch.float32
        )


def block_classes(model: PreTrainedModel) -> tuple[type[torch.nn.Module], ...]:
    """The transformer block classes (HF's `_no_split_modules`) that sharding and checkpointing wrap."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ConfigError(f"model.arch = {model.config.model_type!r}: no transformer blocks found to wrap")
    return tuple(classes)
