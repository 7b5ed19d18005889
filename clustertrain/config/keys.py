"""Every config key with its type, default and help, walked from the schema (`clustertrain config keys`)."""

from __future__ import annotations

import difflib
import json
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from clustertrain.config.schema import RunConfig
from clustertrain.errors import ConfigError


@dataclass(frozen=True)
class Key:
    """One settable key: `name` is dotted (`data.sources.N.path` for the items of a list of sections)."""

    name: str
    type: str
    default: str
    help: str


def schema_keys(section: str | None = None) -> list[Key]:
    """The keys of the schema in its order, or those under `section` (a section or any dotted prefix).

    Raises:
        ConfigError: `section` names no key, with the closest names.
    """
    keys = list(_walk(RunConfig, "", RunConfig().model_dump(mode="json", by_alias=True)))
    if section is None:
        return keys
    chosen = [key for key in keys if key.name == section or key.name.startswith(section + ".")]
    if not chosen:
        prefixes = sorted({".".join(key.name.split(".")[:i]) for key in keys for i in (1, 2)})
        near = difflib.get_close_matches(section, prefixes, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(near)}?)" if near else f"; sections: {', '.join(RunConfig.model_fields)}"
        raise ConfigError(f"config keys {section}: no such section or key{hint}")
    return chosen


def _walk(model: type[BaseModel], prefix: str, defaults: dict[str, Any] | None) -> Any:
    for name, field in model.model_fields.items():
        key = field.alias or name
        dotted = f"{prefix}{key}"
        section = _section_of(field.annotation)
        default = (defaults or {}).get(key, _plain_default(field))
        if section is not None and get_origin(_without_none(field.annotation)) is not list:
            yield from _walk(section, dotted + ".", default if isinstance(default, dict) else None)
            continue
        if section is not None:  # a list of sections: the list itself, then its items' keys
            yield Key(dotted, f"list of {section.__name__} entries", _shown(default), field.description or "")
            yield from _walk(section, dotted + ".N.", None)
            continue
        yield Key(dotted, type_name(field.annotation), _shown(default), field.description or "")


def _plain_default(field: Any) -> Any:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return None
    else:
        value = field.default
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _shown(value: Any) -> str:
    return json.dumps(value, default=str)


def _without_none(annotation: Any) -> Any:
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    return args[0] if _is_union(annotation) and len(args) == 1 else annotation


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (itself, optional, or a list of them), else None."""
    annotation = _without_none(annotation)
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def type_name(annotation: Any) -> str:
    """A field's type as a user writes its values: `float`, `ddp|zero2|...`, `int | null`, `list[str]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "|".join(str(arg).lower() if isinstance(arg, bool) else str(arg) for arg in args)
    if _is_union(annotation):
        return " | ".join("null" if arg is type(None) else type_name(arg) for arg in args)
    if origin is not None and hasattr(annotation, "__metadata__"):  # Annotated[...]
        return type_name(args[0])
    if origin in (list, tuple):
        inner = ", ".join(type_name(arg) for arg in args if arg is not Ellipsis)
        return f"list[{inner}]" if origin is list else f"[{inner}]"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def describe_keys(keys: list[Key]) -> str:
    """The keys as `name: type = default` lines, each followed by its help, indented."""
    lines = []
    for key in keys:
        lines.append(f"{key.name}: {key.type} = {key.default}")
        if key.help:
            lines.append(f"    {key.help}")
    return "\n".join(lines) + "\n"
