"""Convert another trainer's config into a clustertrain config (`clustertrain config convert`).

Reads a torchtitan TOML, HF/TRL `TrainingArguments` as JSON or YAML with an optional DeepSpeed JSON, or the
DDP/ZeRO training stub's YAML. Each format is a table (clustertrain/config/convert_tables.py) from its dotted
keys to ours; a key no table maps, or a value with no counterpart, is reported in one line, never dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from clustertrain.config import convert_tables as tables
from clustertrain.config.convert_tables import Unmapped
from clustertrain.config.keys import schema_keys
from clustertrain.config.load import read_config_file, read_utf8, set_dotted, validate
from clustertrain.errors import ConfigError

FORMATS = ("torchtitan", "hf", "stub")
_FORMAT_NAMES = {"torchtitan": "torchtitan TOML", "hf": "HF/TRL TrainingArguments", "stub": "training stub YAML",
                 "deepspeed": "DeepSpeed JSON"}


@dataclass
class Conversion:
    """A converted config: `config` holds only the keys mapped, nested; `unmapped` one line per key not."""

    source: str
    config: dict[str, Any] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)

    def to_yaml(self, origin: str) -> str:
        """The config as YAML, headed by where it came from and followed by the keys not mapped, as comments."""
        lines = [f"# converted from {origin} ({_FORMAT_NAMES[self.source]}) by `clustertrain config convert`"]
        lines += [f"# not mapped: {line}" for line in self.unmapped]
        return "\n".join(lines) + "\n" + yaml.safe_dump(self.config, sort_keys=False)


def convert(path: str | Path, deepspeed: str | Path | None = None, source: str | None = None) -> Conversion:
    """Convert the config at `path` (and a DeepSpeed JSON) into a clustertrain config, checked by the schema.

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
        deepspeed = path.parent / flat["deepspeed"]  # TrainingArguments name their DeepSpeed JSON
    if source == "hf" and not set(data) & tables.HF_MARKERS and set(data) & tables.DEEPSPEED_MARKERS:
        if deepspeed is not None:
            raise ConfigError(f"{path} is a DeepSpeed JSON; give the TrainingArguments first, then it")
        flat, deepspeed = {}, path  # a DeepSpeed JSON alone
    conversion = Conversion(source)
    targets = _apply(tables.RULES[source], flat, conversion.unmapped)
    if deepspeed is not None:
        ds_flat = {k: v for k, v in flatten(_read(Path(deepspeed))).items() if v != "auto"}  # auto: from the others
        ds_lines: list[str] = []
        targets.update(_apply(tables.RULES["deepspeed"], ds_flat, ds_lines))
        conversion.unmapped += [f"{Path(deepspeed).name}: {line}" for line in ds_lines]
        flat = {**flat, **{f"deepspeed:{k}": v for k, v in ds_flat.items()}}
    tables.FINISH[conversion.source](flat, targets, conversion.unmapped)
    conversion.config = _nested(targets)
    try:
        validate(json.loads(json.dumps(conversion.config)))
    except ConfigError as e:
        raise ConfigError(f"{path}: the converted config is refused: {' / '.join(str(e).splitlines())}") from None
    return conversion


def _read(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = json.loads(read_utf8(path, "config file"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        return data
    return read_config_file(path)


def detect_format(path: Path, data: dict[str, Any]) -> str:
    """torchtitan for a TOML; TrainingArguments or the stub by their keys for JSON and YAML."""
    if path.suffix == ".toml":
        return "torchtitan"
    keys = set(data)
    if keys & tables.STUB_MARKERS and path.suffix != ".json":
        return "stub"
    if keys & (tables.HF_MARKERS | tables.DEEPSPEED_MARKERS) or path.suffix == ".json":
        return "hf"
    raise ConfigError(f"{path}: neither TrainingArguments keys ({', '.join(sorted(tables.HF_MARKERS)[:4])}, ...) nor "
                      f"the training stub's ({', '.join(sorted(tables.STUB_MARKERS)[:4])}, ...); name the format "
                      "with --from")


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
    target keys and values (or raises Unmapped with the reason); a key with no rule is unmapped."""
    targets: dict[str, Any] = {}
    for key, value in flat.items():
        rule = rules.get(key)
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
