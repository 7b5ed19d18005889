"""Load a RunConfig from YAML or TOML plus dotted `--set` overrides, reporting every problem at once."""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from clustertrain.config.schema import ModelConfig, RunConfig
from clustertrain.config.secrets import find_secrets
from clustertrain.errors import ConfigError, one_line

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Check = Callable[[RunConfig], list[str]]  # a config's problems beyond the schema's, one line each


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                checks: Sequence[Check] = ()) -> RunConfig:
    """Read `path` (.yaml, .yml or .toml; None for the embedded default) and apply `key=value` overrides.

    The schema is checked here; the model's checks are `clustertrain.model.spec.load_checked_config`'s, which
    passes them as `checks` (config/ cannot import model/).

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
        _seed_default_list(raw, key)
        set_dotted(raw, key, value)
    return validate(raw, checks)


def _seed_default_list(raw: dict[str, Any], key: str) -> None:
    """`--set optim.betas.1=0.98` on a config without optim.betas changes one item of the default pair: a list
    of values an index reaches is filled in from the default first (a list of sections is replaced whole)."""
    parts = key.split(".")
    node: Any = raw
    default: Any = RunConfig().model_dump()
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node, dict) or not isinstance(default, dict) or part not in default:
            return
        if parts[i + 1].isdigit():
            items = default[part]
            if part not in node and isinstance(items, (list, tuple)) and not any(isinstance(i, dict) for i in items):
                node[part] = list(items)
            return
        node, default = node.setdefault(part, {}), default[part]


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
            if _DEEP_TOML_KEY.search(text):  # tomllib takes time quadratic in a dotted key's parts: minutes
                raise ConfigError(f"{path}: {TOO_DEEP}")
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"{path}: unknown config format {path.suffix!r}; use .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {one_line(e)}") from None
    except RecursionError:  # tomllib, like PyYAML, reads nesting by recursion
        raise ConfigError(f"{path}: {TOO_DEEP}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return check_depth(data, path)


def check_depth(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """`data`, once no value in it is nested deeper than MAX_DEPTH levels: what reads it later (flattening,
    validation, dumping) recurses, and a file must not turn that into a RecursionError."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{path}: {TOO_DEEP}")
        children = value.values() if isinstance(value, dict) else value
        stack += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
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
    """A config-like file's text; a file that is not UTF-8, or past MAX_CONFIG_BYTES, is a one-line ConfigError."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:  # the YAML parser reads ~1 MB/s: a 100 MB file would look like a hang
        raise ConfigError(f"{what} {path} is {size / 2**20:,.0f} MiB; a config is a few KB, and at most "
                          f"{MAX_CONFIG_BYTES // 2**20} MiB is read")
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
MAX_DEPTH = 100
TOO_DEEP = f"nested too deeply to read (more than {MAX_DEPTH} levels); a config needs a few"
MAX_CONFIG_BYTES = 4 * 2**20
_DEEP_TOML_KEY = re.compile(rf"^[ \t]*\[{{0,2}}[ \t]*(?:[^\s.=\[\]]+[ \t]*\.[ \t]*){{{MAX_DEPTH}}}", re.MULTILINE)
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


    def construct_refused(self, node: yaml.Node) -> Any:
        """Tags beyond text, numbers, booleans, null, lists and mappings (and implicit dates): `!!binary` would
        turn a path into decoded bytes, `!!set` and `!!omap` a value into something no key takes."""
        raise RefusedYaml(f"the tag {node.tag.replace('tag:yaml.org,2002:', '!!')} at line "
                          f"{node.start_mark.line + 1} is not a config value; write plain text, numbers, lists or "
                          "mappings")


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)
for _tag in ("binary", "set", "omap", "pairs"):
    _UniqueKeyLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _UniqueKeyLoader.construct_refused)


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
    """Set `a.b.c` in a nested dict, creating intermediate mappings; a number indexes a list
    (`data.sources.0.path`), and the index one past the end appends an item (a list not given is empty)."""
    *parents, leaf = key.split(".")
    node: Any = tree
    for i, part in enumerate(parents):
        follows_index = (parents + [leaf])[i + 1].isdigit()
        if isinstance(node, list):
            node = _list_item(node, part, key, ".".join(parents[:i]), {} if not follows_index else [])
            continue
        child = node.setdefault(part, [] if follows_index else {})
        if isinstance(child, list) and not follows_index:
            where = ".".join(parents[: i + 1])
            raise ConfigError(f"override {key}: {where} is a list; index its items by number, e.g. {where}.0")
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"override {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    if isinstance(node, list):
        index = _index(node, leaf, key, ".".join(parents))
        node[index:index + 1] = [value]
    else:
        node[leaf] = value


def _index(items: list[Any], part: str, key: str, where: str) -> int:
    if not part.isdigit():
        raise ConfigError(f"override {key}: {where} is a list; index its items by number, e.g. {where}.0")
    index = int(part)
    if index > len(items):
        have = (f"has {len(items)} item(s), index 0 to {len(items) - 1}" if items
                else "has no items here (an override starts the list; a default one is replaced)")
        raise ConfigError(f"override {key}: {where} {have}; give one of them, or {len(items)} to append one")
    return index


def _list_item(items: list[Any], part: str, key: str, where: str, empty: Any) -> Any:
    """The item at `part` of `items` (appended as `empty` at the end), a section or list to descend into."""
    index = _index(items, part, key, where)
    if index == len(items):
        items.append(empty)
    if not isinstance(items[index], (dict, list)):
        raise ConfigError(f"override {key}: {where}.{index} is a value, not a section")
    return items[index]


def validate(raw: dict[str, Any], checks: Sequence[Check] = ()) -> RunConfig:
    """Validate a raw dict into a RunConfig, collecting every problem into one ConfigError: the schema's, then
    those of `checks` (each gives one line per problem of the config it is handed) and any secrets."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err) for err in _merge_union_errors(e.errors()))) from None
    problems = [problem for check in checks for problem in check(config)]
    problems += find_secrets(config.model_dump(mode="json"))
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
    if not loc or message.startswith(f"{key}."):  # a rule across sections, or a section's, names its keys itself
        return f"config error: {message}"
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


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, in schema order; reading it back gives the same run."""
    data = config.model_dump(mode="json", by_alias=True)
    if config.model.pretrained and "config" not in config.model.model_fields_set:
        data["model"]["config"] = {}  # the default sizes would override the snapshot's once set in a file
    if "micro_batch_size" not in config.train.model_fields_set:  # the default is capped; a value set must fit
        data["train"]["micro_batch_size"] = min(config.train.micro_batch_size, config.train.global_batch_size)
    return yaml.safe_dump(data, sort_keys=False)
