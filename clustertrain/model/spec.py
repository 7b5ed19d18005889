"""What a model config allows and what a layout needs of the model: the model's facts, checked against transformers
before any process starts (the model's config.json at most, never weights).

    lines = model_config_problems(config)   # one line per problem; clustertrain.resolve.load runs it on every load
    shape = model_shape(config.model, config.data.vocab_size)   # heads, layers, whether tp and pp can split it
    problems = check_world(config, world_size=8, local_world_size=8, shape=shape)   # clustertrain.config.layout
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from clustertrain.config.layout import ModelShape
from clustertrain.config.remote_code import custom_code
from clustertrain.config.schema import ModelConfig, RunConfig
from clustertrain.errors import ConfigError, one_line
from clustertrain.model.build import build_hf_config, hf_config_from
from clustertrain.model.families import Family, Plan, families, family_of

# The tensor-parallel styles a plan may use (`clustertrain.parallel.tp.STYLES` applies them).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")


def model_shape(model: ModelConfig, vocab_size: int) -> ModelShape:
    """What clustertrain.config.layout needs of a model to check a layout: heads, layers, and whether tp and pp
    can split its family. From the snapshot's config.json, or model.arch and model.config: no weights, no
    tokenizer (`vocab_size` only completes a from-scratch config; it does not matter to the layout)."""
    config = build_hf_config(model, None, model.config_fields.get("vocab_size", vocab_size))

    def problem(plan) -> str | None:
        try:
            plan(config)
        except ConfigError as e:
            return str(e)
        return None

    heads = getattr(config, "num_attention_heads", None)
    return ModelShape(config.model_type, heads, getattr(config, "num_key_value_heads", None) or heads,
                      getattr(config, "num_hidden_layers", None), problem(tp_plan), problem(stage_family),
                      problem(norms))


def tp_plan(config: PretrainedConfig) -> dict[str, str]:
    """The model's tensor-parallel plan (transformers' `base_model_tp_plan`, or its family's), or a one-line error
    for an architecture we cannot split."""
    family = family_of(config.model_type)
    plan = getattr(config, "base_model_tp_plan", None) or (family and family.tp_plan)
    if not plan:
        raise ConfigError(f"parallel.tp = {config.model_type!r} has no tensor-parallel plan (its layers are not "
                          "plain linears we can split); use parallel.tp: 1")
    unknown = {s for s in plan.values() if s not in TP_STYLES}
    if unknown:
        raise ConfigError(f"parallel.tp: the {config.model_type!r} plan uses styles {sorted(unknown)}, which "
                          f"clustertrain does not support (only {sorted(TP_STYLES)}); use parallel.tp: 1")
    return plan


def norms(config: PretrainedConfig) -> tuple[str, ...]:
    """The patterns of the model's norms (and other per-token modules) that sequence parallelism runs on a slice
    of the sequence: its family's declaration (`clustertrain.model.families.Family.norms`).

    Raises:
        ConfigError: no family declares them for this model type.
    """
    family = family_of(config.model_type)
    if family is None or not family.norms:
        declared = sorted(t for t, f in families().items() if f.norms)
        raise ConfigError(f"parallel.sequence_parallel: {config.model_type!r} declares no norms (a model family "
                          f"does: {', '.join(declared)}); use parallel.sequence_parallel: false")
    return family.norms


def pipeline_plan(config: PretrainedConfig) -> Plan:
    """Where the base model keeps its embeddings, decoder layers and final norm: transformers' shipped
    `base_model_pp_plan`, else its family's (GPT-2, OPT).

    Raises:
        ConfigError: the architecture has neither.
    """
    shipped = getattr(config, "base_model_pp_plan", None)
    family = family_of(config.model_type)
    plan = shipped if isinstance(shipped, dict) and shipped else family and family.pp_plan
    if not plan:
        raise ConfigError(f"model.arch = {config.model_type!r}: pipeline parallel is not supported for it "
                          "(no base_model_pp_plan in transformers, none in clustertrain)")
    return plan


def stage_family(config: PretrainedConfig) -> Family:
    """The family whose stage forward runs `config`'s model, once its pieces can be found (`pipeline_plan`).

    Raises:
        ConfigError: pipeline parallel cannot run the architecture.
    """
    pipeline_plan(config)
    family = family_of(config.model_type)
    if family is None:
        raise ConfigError(f"model.arch = {config.model_type!r}: pipeline parallel is not supported for it "
                          f"(clustertrain mirrors the forward of {', '.join(sorted(families()))} only)")
    return family


def model_config_problems(config: RunConfig) -> list[str]:
    """model.config keys must be fields of the HF config class of model.arch (or of a local model.path snapshot),
    and the model they describe must be buildable: the HF config class's checks and our own shape checks. One
    line per problem, [] when there is none."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings about a config are ours to say, in one line, or not at all
    try:
        return _check_model(config)
    finally:
        hf_logging.set_verbosity(level)


def _check_model(config: RunConfig) -> list[str]:
    from transformers import AutoConfig

    try:
        defaults = AutoConfig.for_model(config.model.arch)
    except ValueError:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        hint = difflib.get_close_matches(config.model.arch, list(CONFIG_MAPPING.keys()), n=3)
        return [f"config error: model.arch = {config.model.arch!r} is not a transformers model type"
                + (f" (did you mean {', '.join(hint)}?)" if hint else "")]
    snapshot = _local_snapshot(config)
    if isinstance(snapshot, str):
        return [snapshot]
    where = "model.arch" if snapshot is None else f"model.path ({snapshot.model_type})"
    not_causal = _not_decoder_only(config.model.arch if snapshot is None else snapshot.model_type,
                                   defaults if snapshot is None else snapshot, where)
    if not_causal:
        return [not_causal]
    base = snapshot or defaults
    model_type = config.model.config.get("model_type", base.model_type)
    if model_type != base.model_type:
        return [f"config error: model.config.model_type = {model_type!r} is not {where}'s {base.model_type!r}; "
                "drop it or set model.arch to it"]
    known = set(base.to_dict()) | set(dir(base))
    problems = []
    for key, value in config.model.config_fields.items():
        if key not in known and not _config_json_key(base, key, value):
            hint = difflib.get_close_matches(key, sorted(k for k in known if not k.startswith("_")), n=1)
            problems.append(
                f"config error: unknown key 'model.config.{key}' for {base.model_type}"
                + (f" (did you mean 'model.config.{hint[0]}'?)" if hint else "")
            )
    if problems or (config.model.pretrained and snapshot is None):  # a hub_id snapshot is found when the run starts
        return problems
    problem = _check_model_values(config, base) or _check_lora_targets(config, base)
    return [problem] if problem else []


# Keys that real config.json files carry and the HF config class no longer lists: transformers 4's generic
# PretrainedConfig arguments (generation defaults, task metadata) and fields that transformers dropped.
CONFIG_JSON_EXTRAS = frozenset({
    "torch_dtype", "transformers_version", "architectures", "task_specific_params", "prefix", "finetuning_task",
    "id2label", "label2id", "num_labels", "problem_type", "tokenizer_class", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "pruned_heads",
    "chunk_size_feed_forward", "is_decoder", "cross_attention_hidden_size", "add_cross_attention",
    "tie_encoder_decoder", "sep_token_id", "decoder_start_token_id",
    "n_ctx", "activation_dropout", "use_mrope",  # read by no transformers 5 class: GPT-2's, OPT's, Qwen2.5's
})


def _config_json_key(base: Any, key: str, value: Any) -> bool:
    """Whether `key`, unknown to the HF config class, is still a key of real config.json files: private metadata
    (`_name_or_path`), a CONFIG_JSON_EXTRAS key, or a legacy name the class reads into another field (transformers
    5 reads rope_theta and rope_scaling into rope_parameters)."""
    if key.startswith("_") or key in CONFIG_JSON_EXTRAS:
        return True
    try:
        return key not in type(base)(**{key: value}).to_dict()
    except Exception:  # noqa: BLE001 - the class refuses the value, so it reads the key: its checks come later
        return True


def _local_snapshot(config: RunConfig) -> Any:
    """The HF config of a local model.path snapshot (None for a model built from scratch, a hub_id, or a path not
    there yet, as on a login node rendering a job), or a one-line problem."""
    from transformers import AutoConfig

    path = Path(config.model.path) if config.model.path else None
    if path is None or not (path / "config.json").is_file():
        return None
    if problem := custom_code(path):
        return f"config error: model.path: {problem}"
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - json, unknown model types, the class's own checks
        return f"config error: model.path: {path / 'config.json'} cannot be read: {one_line(e)}"


# Sizes that must be positive whatever the architecture calls them (GPT-2's n_embd, OPT's ffn_dim, ...).
SIZE_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "max_position_embeddings", "vocab_size", "head_dim", "n_embd", "n_layer", "n_head", "n_positions",
             "n_inner", "n_ctx", "ffn_dim", "word_embed_proj_dim", "d_model", "num_layers", "num_heads"}


def _not_decoder_only(arch: str, defaults: Any, where: str = "model.arch") -> str | None:
    """A one-line refusal if `arch` is not a decoder-only causal LM (encoders such as bert, encoder-decoders)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    supported = [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in MODEL_FOR_MASKED_LM_MAPPING_NAMES]
    if arch in supported and not getattr(defaults, "is_encoder_decoder", False):
        return None
    what = ("an encoder-decoder" if getattr(defaults, "is_encoder_decoder", False)
            else "an encoder (masked LM)" if arch in MODEL_FOR_MASKED_LM_MAPPING_NAMES else "not a causal LM")
    common = [t for t in ("llama", "gpt2", "opt", "qwen2", "mistral", "gemma", "phi", "falcon", "mixtral")
              if t in supported]
    return (f"config error: {where} = {arch!r} is {what}; clustertrain trains decoder-only causal LMs: the "
            f"{len(supported)} model types of transformers' AutoModelForCausalLM that are not encoders, "
            f"e.g. {', '.join(common)}")


def _hf_config(config: RunConfig) -> PretrainedConfig:
    """The HF config the run will build (`build_hf_config`'s, before the tokenizer sizes it): the local snapshot's
    config or model.arch's defaults, with model.config on top; the HF config class's own errors pass through."""
    snapshot = Path(config.model.path) if config.model.pretrained else None
    return hf_config_from(config.model, snapshot, config.model.config_fields)


def _check_model_values(config: RunConfig, base: Any) -> str | None:
    """model.config values that cannot build a model: built by the HF config class, then our own shape checks.
    `base` holds the values the user did not set (the arch's defaults, or a snapshot's config)."""
    fields = config.model.config_fields
    for key, value in fields.items():
        if key in SIZE_KEYS and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"config error: model.config.{key} = {value!r}: must be a whole number"
        if key in SIZE_KEYS and value is not None and value <= 0:
            return f"config error: model.config.{key} = {value!r}: must be positive"
    mapped = getattr(base, "attribute_map", {})

    def key(name: str) -> str:  # the name the user writes for a field (GPT-2: hidden_size -> n_embd)
        return f"model.config.{mapped.get(name, name)}"

    def get(name: str) -> Any:
        value = fields.get(mapped.get(name, name), fields.get(name, getattr(base, name, None)))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    hidden, heads, layers = (get(n) for n in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
    # From scratch, head_dim and num_key_value_heads follow hidden_size and heads unless set; a snapshot has its own.
    given = {*fields, *(base.to_dict() if config.model.pretrained else ())}
    kv = get("num_key_value_heads") if mapped.get("num_key_value_heads", "num_key_value_heads") in given else None
    has_head_dim = "head_dim" in given
    if layers is not None and layers < 1:
        return f"config error: {key('num_hidden_layers')} = {layers}: a model needs at least one layer"
    if hidden and heads and not has_head_dim and hidden % heads:
        return (f"config error: {key('hidden_size')} = {hidden} is not divisible by {key('num_attention_heads')} = "
                f"{heads}")
    if heads and kv and heads % kv:
        return (f"config error: {key('num_key_value_heads')} = {kv} does not divide {key('num_attention_heads')} "
                f"= {heads}")
    for name in ("hidden_act", "activation_function"):
        if isinstance(fields.get(name), str):
            from transformers.activations import ACT2FN

            if fields[name] not in ACT2FN:
                return (f"config error: model.config.{name} = {fields[name]!r} is not an activation transformers "
                        f"knows (e.g. silu, gelu, gelu_new, relu)")
    try:
        _hf_config(config)
    except Exception as e:  # noqa: BLE001 - the HF config class's own checks, of many exception types
        return f"config error: model.config: {base.model_type} rejects these values: {one_line(e)}"
    positions = get("max_position_embeddings")
    if positions and config.data.seq_len > positions:
        return (f"config error: data.seq_len = {config.data.seq_len} is longer than {key('max_position_embeddings')} "
                f"= {positions}, the longest sequence the model can take")
    return None


def _check_lora_targets(config: RunConfig, base: Any) -> str | None:
    """lora.target_modules must name modules of the model (peft would fail with a traceback when the run starts)."""
    targets = config.lora.target_modules
    if not config.lora.enabled or isinstance(targets, str):
        return None
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(config), trust_remote_code=False)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if not missing:
        return None
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return (f"config error: lora.target_modules: {', '.join(map(repr, missing))} is not a module of "
            f"{base.model_type}; its linear layers are {', '.join(linear)}")
