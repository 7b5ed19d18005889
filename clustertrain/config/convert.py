"""Convert another trainer's config into a clustertrain config (`clustertrain config convert`).

Reads a torchtitan TOML, HF/TRL `TrainingArguments` as JSON or YAML with an optional DeepSpeed JSON, or the
DDP/ZeRO training stub's YAML. Each format is a table (clustertrain/config/convert_tables.py) from its dotted
keys to ours; a key no table maps, or a value with no counterpart, is reported in one line, never dropped.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from clustertrain.config import convert_tables as tables
from clustertrain.config.convert_tables import HF_DEFAULTS, LLAMA3_COMMON, LLAMA3_FLAVORS, Unmapped
from clustertrain.config.keys import schema_keys
from clustertrain.config.load import TOO_DEEP, check_depth, read_config_file, read_utf8, set_dotted, validate
from clustertrain.config.strategy import strategy_of_stage
from clustertrain.errors import ConfigError

FORMATS = ("torchtitan", "hf", "stub")
_FORMAT_NAMES = {"torchtitan": "torchtitan TOML", "hf": "HF/TRL TrainingArguments", "stub": "training stub YAML",
                 "deepspeed": "DeepSpeed JSON"}


@dataclass
class Conversion:
    """A converted config: `config` holds only the keys mapped, nested; `unmapped` one line per key not;
    `warnings` one line per key present but inert in its own trainer; `inputs` the files read (which an output
    must never replace)."""

    source: str
    config: dict[str, Any] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    inputs: list[Path] = field(default_factory=list)

    def to_yaml(self, origin: str) -> str:
        """The config as YAML, headed by where it came from, the keys not mapped and the warnings, as comments."""
        lines = [f"converted from {origin} ({_FORMAT_NAMES[self.source]}) by `clustertrain config convert`"]
        lines += [f"not mapped: {line}" for line in self.unmapped] + [f"warning: {line}" for line in self.warnings]
        return "".join(f"# {one_line(line)}\n" for line in lines) + yaml.safe_dump(self.config, sort_keys=False)


def one_line(text: str) -> str:
    """`text` with every character that could end a line or steer a terminal escaped (`\\n`, `\\x85`, `\\u2028`):
    control and format characters, line and paragraph separators, lone surrogates. Key names and values of an
    input file reach a comment of the output, and a line break there would turn the rest of the name into YAML."""
    return "".join(c if unicodedata.category(c) not in _UNSAFE else ascii(c)[1:-1] for c in text)


_UNSAFE = {"Cc", "Cf", "Zl", "Zp", "Cs"}  # YAML's line breaks (\n \r \x85 \u2028 \u2029) are all among them


def convert(path: str | Path, deepspeed: str | Path | None = None, source: str | None = None) -> Conversion:
    """Convert the config at `path` (and a DeepSpeed JSON) into a clustertrain config, checked by the schema (its
    paths' $VARIABLES must be set, as for any config; the config keeps them as written).

    Args:
        path: a torchtitan .toml, TrainingArguments .json/.yaml, or training stub .yaml.
        deepspeed: a DeepSpeed JSON; default: the TrainingArguments' own `deepspeed` key, if any.
        source: one of FORMATS; default: told from the file's extension and keys.

    Raises:
        ConfigError: an unreadable file, a format that cannot be told, or a result the schema refuses.
    """
    path = Path(path)
    data = _read(path)
    source = source or detect_format(path, data)
    if source not in FORMATS:
        raise ConfigError(f"--from {source}: use one of {', '.join(FORMATS)}")
    flat = flatten(data)
    if source == "hf" and deepspeed is None and isinstance(flat.get("deepspeed"), str):
        deepspeed = _named_deepspeed(path, flat["deepspeed"])
    if source == "hf" and not set(data) & tables.HF_MARKERS and set(data) & tables.DEEPSPEED_MARKERS:
        if deepspeed is not None:
            raise ConfigError(f"{path} is a DeepSpeed JSON; give the TrainingArguments first, then it")
        flat, deepspeed = {}, path  # a DeepSpeed JSON alone
    conversion = Conversion(source, inputs=[path])
    targets = _apply(tables.RULES[source], flat, conversion.unmapped)
    if deepspeed is not None:
        conversion.inputs.append(Path(deepspeed))
        ds_flat = {k: v for k, v in flatten(_read(Path(deepspeed))).items() if v != "auto"}  # auto: from the others
        ds_lines: list[str] = []
        targets.update(_apply(tables.RULES["deepspeed"], ds_flat, ds_lines))
        conversion.unmapped += [f"{Path(deepspeed).name}: {line}" for line in ds_lines]
        flat = {**flat, **{f"deepspeed:{k}": v for k, v in ds_flat.items()}}
    FINISH[conversion.source](flat, targets, conversion.unmapped)
    if source == "hf":
        conversion.warnings += inert_lora(flat)
    conversion.config = _nested(targets)
    try:
        validate(conversion.config)
    except ConfigError as e:
        raise ConfigError(f"{path}: the converted config is refused: {' / '.join(str(e).splitlines())}") from None
    return conversion


def _named_deepspeed(path: Path, named: str) -> Path:
    """The DeepSpeed JSON that TrainingArguments' `deepspeed` key names: from the working directory, as HF reads
    it, or else next to the arguments' file."""
    for candidate in (Path(named), path.parent / named):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{path}: deepspeed = {named!r}: no such file here or next to {path.name}; give the DeepSpeed "
                      "JSON as the second argument")


def _read(path: Path) -> dict[str, Any]:
    if path.suffix != ".json":
        return read_config_file(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = json.loads(read_utf8(path, "config file"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    except RecursionError:  # json reads nesting by recursion
        raise ConfigError(f"{path}: {TOO_DEEP}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return check_depth(data, path)


def detect_format(path: Path, data: dict[str, Any]) -> str:
    """torchtitan for a TOML; for JSON and YAML, the stub by its sections (TrainingArguments are flat, but for
    lr_scheduler_kwargs), TrainingArguments or a DeepSpeed JSON by their keys."""
    if path.suffix == ".toml":
        return "torchtitan"
    keys = set(data)
    sections = {key for key, value in data.items() if isinstance(value, dict)}
    if sections & tables.STUB_SECTIONS and path.suffix != ".json":
        return "stub"
    if keys & (tables.HF_MARKERS | tables.DEEPSPEED_MARKERS) or path.suffix == ".json":
        return "hf"
    raise ConfigError(f"{path}: neither TrainingArguments keys ({', '.join(sorted(tables.HF_MARKERS)[:4])}, ...) nor "
                      f"the training stub's sections ({', '.join(sorted(tables.STUB_SECTIONS)[:4])}, ...); name the "
                      "format with --from")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists and values as they are."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _apply(rules: dict[str, Any], flat: dict[str, Any], unmapped: list[str]) -> dict[str, Any]:
    """Each source key through its rule: a target key (the value copied) or a function of the value that returns
    target keys and values (or raises Unmapped with the reason); a key with no rule is unmapped. A rule under
    `section.*` takes every key of that section that has none of its own."""
    targets: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        wildcards = (".".join(parts[:i]) + ".*" for i in range(len(parts) - 1, 0, -1))  # the longest first
        rule = rules.get(key) or next((rules[w] for w in wildcards if w in rules), None)
        try:
            if rule is None:
                raise Unmapped("no clustertrain key for it")
            targets.update({rule: value} if isinstance(rule, str) else rule(value))
        except Unmapped as why:
            unmapped.append(f"{key} = {json.dumps(value, default=str)}: {why}")
    return targets


def _nested(targets: dict[str, Any]) -> dict[str, Any]:
    """Dotted targets as a nested config, in the schema's order of keys."""
    order = {key.name: i for i, key in enumerate(schema_keys())}

    def rank(key: str) -> tuple[int, str]:
        general = ".".join("N" if part.isdigit() else part for part in key.split("."))
        return order.get(general, len(order)), key

    config: dict[str, Any] = {}
    for key in sorted(targets, key=rank):
        set_dotted(config, key, targets[key])
    return config


# What depends on several keys at once: the parallel strategy, epochs or steps, a minimum lr given as a value.

def _betas(targets: dict[str, Any], default: tuple[float, float]) -> None:
    """Betas given one at a time (beta1, beta2) as the pair optim.betas, the other from the source's default;
    a pair given whole (DeepSpeed's optimizer.params.betas) wins."""
    parts = [targets.pop(f"optim.betas.{i}", None) for i in (0, 1)]
    if any(p is not None for p in parts) and "optim.betas" not in targets:
        targets["optim.betas"] = [d if p is None else p for p, d in zip(parts, default)]


def _min_lr(value: Any, targets: dict[str, Any], unmapped: list[str], key: str) -> None:
    """A minimum lr given as a value: the ratio to the peak lr."""
    lr = targets.get("optim.lr")
    if isinstance(value, (int, float)) and isinstance(lr, (int, float)) and lr > 0 and value <= lr:
        targets["optim.min_lr_ratio"] = value / lr
    else:
        unmapped.append(f"{key} = {value}: with no peak lr to divide it by; give optim.min_lr_ratio")


def finish_torchtitan(flat: dict[str, Any], targets: dict[str, Any], unmapped: list[str]) -> None:
    """The model's sizes from its flavor, the strategy from the data-parallel degrees (FSDP over all data-parallel
    ranks unless told otherwise, as in torchtitan), the checkpoint interval unless checkpoints are off."""
    flavor = flat.get("model.flavor")
    if flavor is not None and flat.get("model.name") == "llama3" and flavor in LLAMA3_FLAVORS:
        targets["model.config"] = {**LLAMA3_FLAVORS[flavor], **LLAMA3_COMMON}
    elif flavor is not None:
        unmapped.append(f"model.flavor = {flavor!r}: no sizes known for it (llama3 {', '.join(LLAMA3_FLAVORS)} "
                        "are); give model.config (hidden_size, num_hidden_layers, ...) or model.path")

    def degree(name: str, default: Any) -> Any:
        return flat.get(f"parallelism.{name}", flat.get(f"training.{name}", default))

    replicate, shard = degree("data_parallel_replicate_degree", 1), degree("data_parallel_shard_degree", -1)
    zero = "zero2" if degree("fsdp_reshard_after_forward", "default") == "never" else "zero3"
    if shard == 1:
        targets["parallel.strategy"] = "ddp"
    else:
        targets["parallel.strategy"] = f"hybrid_{zero}" if replicate != 1 else zero
        if replicate != 1 and shard > 1:
            targets["parallel.hybrid_shard_size"] = shard
    if "train.global_batch_size" not in targets and "train.micro_batch_size" in targets:
        targets["train.grad_accum"] = 1  # torchtitan's default global batch: the local batch on every dp rank
    enabled = flat.get("checkpoint.enable", flat.get("checkpoint.enable_checkpoint", True))
    if not enabled:
        targets["checkpoint.every"] = 0
    elif "checkpoint.interval" in flat:
        targets["checkpoint.every"] = flat["checkpoint.interval"]
    tables.torchtitan_checkpointing(flat, targets)
    _betas(targets, (0.9, 0.95))


def finish_hf(flat: dict[str, Any], targets: dict[str, Any], unmapped: list[str]) -> None:
    """TrainingArguments' defaults where ours differ, epochs unless max_steps, warmup_ratio as steps, TRL's LoRA
    keys, and the DeepSpeed JSON's ZeRO stage and batch (its keys prefixed `deepspeed:` in `flat`)."""
    _betas(targets, (flat.get("adam_beta1", 0.9), flat.get("adam_beta2", 0.999)))
    for key, value in HF_DEFAULTS.items():
        targets.setdefault(key, value)
    if "train.steps" not in targets:
        epochs = flat.get("num_train_epochs", 3.0)
        targets.update({"train.steps": None, "train.epochs": float(epochs)})
    if "lr_scheduler_kwargs.min_lr" in flat:
        _min_lr(flat["lr_scheduler_kwargs.min_lr"], targets, unmapped, "lr_scheduler_kwargs.min_lr")
    ratio = flat.get("warmup_ratio")
    if ratio and not flat.get("warmup_steps") and "deepspeed:scheduler.params.warmup_num_steps" not in flat:
        if targets.get("train.steps"):
            targets["optim.warmup_steps"] = round(ratio * targets["train.steps"])
        else:
            unmapped.append(f"warmup_ratio = {ratio}: a share of the steps, which epochs leave open; give "
                            "optim.warmup_steps")
    if flat.get("use_peft"):
        targets.update({"lora.rank": flat.get("lora_r", 16), "lora.alpha": flat.get("lora_alpha", 32),
                        "lora.dropout": flat.get("lora_dropout", 0.05)})
        if flat.get("lora_target_modules"):
            targets["lora.target_modules"] = flat["lora_target_modules"]
    stage = flat.get("deepspeed:zero_optimization.stage")
    if stage in (0, 2, 3):
        partition = flat.get("deepspeed:zero_optimization.zero_hpz_partition_size", 1)
        targets["parallel.strategy"] = strategy_of_stage(stage, hybrid=stage == 3 and partition > 1)
        if stage == 3 and partition > 1:
            targets["parallel.hybrid_shard_size"] = partition
    if "deepspeed:train_batch_size" in flat and not ({"gradient_accumulation_steps",
                                                      "deepspeed:gradient_accumulation_steps"} & set(flat)):
        targets.pop("train.grad_accum", None)
        targets["train.global_batch_size"] = flat["deepspeed:train_batch_size"]


def finish_stub(flat: dict[str, Any], targets: dict[str, Any], unmapped: list[str]) -> None:
    """model.hf_config as model.config, batch_size as the batch per rank, and the run directory
    <directory>/<prefix>, where the stub writes its <prefix>.<timestamp> checkpoints."""
    hf_config: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("model.hf_config.") and key != "model.hf_config.model_type":
            set_dotted(hf_config, key.removeprefix("model.hf_config."), value)
    if hf_config:
        targets["model.config"] = hf_config
    if "train.micro_batch_size" in targets:
        targets["train.grad_accum"] = 1
    directory, prefix = flat.get("checkpoint.directory"), flat.get("checkpoint.prefix")
    if directory is not None or prefix is not None:
        targets["train.run_dir"] = "/".join(str(part) for part in (directory, prefix) if part is not None)


def inert_lora(flat: dict[str, Any]) -> list[str]:
    """TRL's lora_* keys, which TRL ignores unless use_peft is true: one line saying so."""
    inert = [key for key in flat if key.startswith("lora_")]
    if not inert or flat.get("use_peft"):
        return []
    return [f"{', '.join(inert)}: inert without use_peft: true (TRL then trains every weight, and so does this "
            "config); add use_peft: true to train LoRA adapters"]


FINISH = {"torchtitan": finish_torchtitan, "hf": finish_hf, "stub": finish_stub}
