"""Load a RunConfig from YAML or TOML plus dotted `--set` overrides, reporting every problem at once."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from clustertrain.config.schema import ModelConfig, RunConfig
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


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a config file by its extension into a plain dict."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"{path}: unknown config format {path.suffix!r}; use .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """Split `optim.lr=3e-4` into the key and a YAML-typed value."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


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
        raise ConfigError("\n".join(_describe(err) for err in e.errors())) from None
    problems = _check_model_fields(config)
    if problems:
        raise ConfigError("\n".join(problems))
    return config


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
    """model.config keys must be fields of the HF config class of model.arch."""
    from transformers import AutoConfig

    try:
        defaults = AutoConfig.for_model(config.model.arch)
    except ValueError:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        hint = difflib.get_close_matches(config.model.arch, list(CONFIG_MAPPING.keys()), n=3)
        return [f"config error: model.arch = {config.model.arch!r} is not a transformers model type"
                + (f" (did you mean {', '.join(hint)}?)" if hint else "")]
    known = set(defaults.to_dict()) | set(dir(defaults))
    problems = []
    for key in config.model.config:
        if key not in known:
            hint = difflib.get_close_matches(key, sorted(k for k in known if not k.startswith("_")), n=1)
            problems.append(
                f"config error: unknown key 'model.config.{key}' for {config.model.arch}"
                + (f" (did you mean 'model.config.{hint[0]}'?)" if hint else "")
            )
    return problems


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, in schema order."""
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)
