"""Load a RunConfig from YAML or TOML plus dotted `--set` overrides, reporting every problem at once."""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from clustertrain.config.remote_code import custom_code
from clustertrain.config.schema import ModelConfig, RunConfig
from clustertrain.config.secrets import find_secrets
from clustertrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read `path` (.yaml, .yml or .toml; None for the embedded default) and apply `key=value` overrides.

    Raises:
        ConfigError: one line per problem, each naming the key, the value and what is allowed.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_config_file(Path(path))
        raw.setdefault("name", Path(path).stem)
    parsed = [parse_override(item) for item in overrides]
    _keep_default_model_fields(raw, [key for key, _ in parsed])
    _one_batch_form(raw, [key for key, _ in parsed])
    for key, value in parsed:
        set_dotted(raw, key, value)
    return validate(raw)


def _keep_default_model_fields(raw: dict[str, Any], keys: list[str]) -> None:
    """`--set model.config.num_hidden_layers=8` on the default model changes one field, not all of them."""
    model = raw.get("model", {})
    if not isinstance(model, dict) or "config" in model or not any(k.startswith("model.config.") for k in keys):
        return
    if model.get("path") or model.get("hub_id") or {"model.path", "model.hub_id"} & set(keys):
        return  # a snapshot's config is the base; the keys set are the only overrides
    defaults = ModelConfig()
    if model.get("arch", defaults.arch) == defaults.arch:
        raw.setdefault("model", {})["config"] = dict(defaults.config)


def _one_batch_form(raw: dict[str, Any], keys: list[str]) -> None:
    """`--set train.global_batch_size=64` on a file that gives the batch per rank (grad_accum) replaces that form,
    and `--set train.grad_accum=4` replaces a file's global batch: the schema takes one form at a time."""
    train = raw.get("train")
    if not isinstance(train, dict):
        return
    for given, other in (("global_batch_size", "grad_accum"), ("grad_accum", "global_batch_size")):
        if f"train.{given}" in keys and f"train.{other}" not in keys:
            train.pop(other, None)


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a config file by its extension into a plain dict."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give the .yaml, .yml or .toml file in it to read")
    if path.exists() and not path.is_file():  # reading a FIFO could block forever, /dev/zero never end
        raise ConfigError(f"config file {path} is not a regular file (a FIFO, device or socket); give a .yaml, .yml "
                          "or .toml file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = read_utf8(path, "config file")
    try:
        if path.suffix in (".yaml", ".yml"):
            data = load_yaml(text, str(path)) or {}
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"{path}: unknown config format {path.suffix!r}; use .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {' '.join(str(e).split())}") from None
    except RecursionError:  # tomllib, like PyYAML, reads nesting by recursion
        raise ConfigError(f"{path}: {TOO_DEEP}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """Split `optim.lr=3e-4` into the key and a YAML-typed value."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
    try:
        parsed = load_yaml(value, f"override {key.strip()}") if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def read_utf8(path: Path, what: str) -> str:
    """A config-like file's text; a file that is not UTF-8 is a one-line ConfigError naming the first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{what} {path} is not UTF-8 text: byte 0x{data[e.start]:02x} at line {line} "
                          f"(offset {e.start}); save it as UTF-8") from None


# Values that aliases may add to a document, counted as the values they stand for: anchors for a few shared
# sections fit easily; a "billion laughs" (aliases of aliases) would expand to billions once validated.
MAX_ALIASED_VALUES = 10_000
TOO_DEEP = "nested too deeply to read (thousands of levels); a config needs a few"
_MERGE = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key given twice (PyYAML would keep the last one silently), an alias
    inside the value it names, and aliases that expand past MAX_ALIASED_VALUES values."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.sizes: dict[int, int] = {}  # id(node) -> the values it holds once aliases are expanded, itself included
        self.aliased = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:
                line = event.start_mark.line + 1
                if id(target) not in self.sizes:  # still being composed: the alias is inside its own anchor
                    raise RefusedYaml(f"the alias *{event.anchor} at line {line} is inside the value it names")
                self.aliased += self.sizes[id(target)]
                if self.aliased > MAX_ALIASED_VALUES:
                    raise RefusedYaml(f"aliases expand past {MAX_ALIASED_VALUES} values by *{event.anchor} at line "
                                      f"{line} (a YAML bomb?); write the values out")
            return super().compose_node(parent, index)
        node = super().compose_node(parent, index)
        children = node.value if isinstance(node, yaml.SequenceNode) else (
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        self.sizes[id(node)] = 1 + sum(self.sizes[id(child)] for child in children)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue  # `<<: *base`: the keys given here override the merged ones, as YAML says
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys: PyYAML's own rules
            line = key_node.start_mark.line + 1
            if key in seen:
                raise RefusedYaml(f"duplicate key {key!r} at line {line} (first at line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        """YAML 1.1's base-60 numbers stay text: `time: 1:30:00` is a Slurm time, not the integer 5400."""
        return self.construct_scalar(node) if ":" in str(node.value) else super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> Any:
        return self.construct_scalar(node) if ":" in str(node.value) else super().construct_yaml_float(node)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)


class RefusedYaml(ValueError):
    """A YAML document our loader refuses: a key given twice, or aliases that loop or expand too far."""


def load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load, refusing duplicate keys and alias bombs with a one-line ConfigError that names `where`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except RefusedYaml as e:
        raise ConfigError(f"{where}: {e}") from None
    except RecursionError:  # PyYAML reads nesting by recursion
        raise ConfigError(f"{where}: {TOO_DEEP}") from None


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b.c` in a nested dict, creating intermediate mappings."""
    *parents, leaf = key.split(".")
    node = tree
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def validate(raw: dict[str, Any]) -> RunConfig:
    """Validate a raw dict into a RunConfig, collecting every problem into one ConfigError."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err) for err in _merge_union_errors(e.errors()))) from None
    problems = _check_model_fields(config) + find_secrets(config.model_dump(mode="json"))
    if problems:
        raise ConfigError("\n".join(problems))
    return config


_UNION_MEMBER = re.compile(r"function-after.*|.*\[.*|int|float|str|bool|list|tuple|dict")


def _merge_union_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One error per key: pydantic reports a value that fits no member of a union (`list[str] | 'all-linear'`) once
    per member, under locations such as `lora.target_modules.list[str]`; join those into one message."""
    merged: dict[tuple[str, ...], dict[str, Any]] = {}
    for err in errors:
        loc = tuple(str(p) for p in err["loc"] if not _UNION_MEMBER.fullmatch(str(p)))
        if loc in merged and err["type"] != "extra_forbidden":
            first = merged[loc]
            first["msg"] += " or " + err["msg"].removeprefix("Input should be ")
        else:
            merged.setdefault(loc, {**err, "loc": loc})
    return list(merged.values())


def _describe(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
    key = ".".join(loc) or "config"
    if err["type"] == "extra_forbidden":
        hint = _suggest(loc)
        return f"config error: unknown key '{key}'" + (f" (did you mean '{hint}'?)" if hint else "")
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" = {value!r}"
    message = err["msg"].removeprefix("Value error, ")
    return f"config error: {key}{shown}: {message}"


def _suggest(loc: list[str]) -> str | None:
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        inner = getattr(annotation, "__args__", (annotation,))
        model = next((t for t in inner if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if model is None:
            return None
    match = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return ".".join([*loc[:-1], match[0]]) if match else None


def _check_model_fields(config: RunConfig) -> list[str]:
    """model.config keys must be fields of the HF config class of model.arch (or of a local model.path snapshot),
    and the model they describe must be buildable: the HF config class's checks and our own shape checks."""
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
        return f"config error: model.path: {path / 'config.json'} cannot be read: {' '.join(str(e).split())}"


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


def _build_hf_config(config: RunConfig, base: Any) -> Any:
    """The HF config the run will build: `base` (arch defaults or the snapshot's) with model.config on top."""
    from transformers import AutoConfig

    if config.model.pretrained:
        return AutoConfig.from_pretrained(config.model.path, local_files_only=True, trust_remote_code=False,
                                          **config.model.config_fields)
    return AutoConfig.for_model(base.model_type, **config.model.config_fields)


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
        _build_hf_config(config, base)
    except Exception as e:  # noqa: BLE001 - the HF config class's own checks, of many exception types
        return f"config error: model.config: {base.model_type} rejects these values: {' '.join(str(e).split())}"
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
        model = AutoModelForCausalLM.from_config(_build_hf_config(config, base), trust_remote_code=False)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if not missing:
        return None
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return (f"config error: lora.target_modules: {', '.join(map(repr, missing))} is not a module of "
            f"{base.model_type}; its linear layers are {', '.join(linear)}")


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, in schema order; reading it back gives the same run."""
    data = config.model_dump(mode="json", by_alias=True)
    if config.model.pretrained and "config" not in config.model.model_fields_set:
        data["model"]["config"] = {}  # the default sizes would override the snapshot's once set in a file
    if "micro_batch_size" not in config.train.model_fields_set:  # the default is capped; a value set must fit
        data["train"]["micro_batch_size"] = min(config.train.micro_batch_size, config.train.global_batch_size)
    return yaml.safe_dump(data, sort_keys=False)
