"""Render the config reference (docs/config.md) from the schema's field descriptions.

    python -m clustertrain.config.docs > docs/config.md
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from clustertrain.config.data_schema import SourceConfig

from clustertrain.config.schema import RunConfig


def render_reference() -> str:
    """Markdown tables of every section's keys, defaults and descriptions."""
    lines = [
        "# Config reference",
        "",
        "Generated from `clustertrain/config/schema.py` by `python -m clustertrain.config.docs`; "
        "a test keeps it current. Set any key in a YAML/TOML file, with `--set section.key=value` or with "
        "`--section.key value` (list items by index: `--data.sources.0.path PATH`); `clustertrain config keys "
        "[SECTION]` prints the same list. `clustertrain config convert` writes a config from a torchtitan TOML, HF/TRL "
        "TrainingArguments with a DeepSpeed JSON, or the DDP/ZeRO training stub's YAML (README: coming from torchtitan "
        "/ TRL / DeepSpeed).",
    ]
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            lines += ["", f"- `{name}` (default `{field.default}`): {field.description}"]
            continue
        lines += ["", f"## `{name}`", "", "| key | default | description |", "| --- | --- | --- |"]
        lines += _rows(name, section)
    lines += ["", "## `data.sources[]` entries", "", "| key | default | description |", "| --- | --- | --- |"]
    for key, sub in SourceConfig.model_fields.items():
        default = json.dumps(sub.default)
        lines.append(f"| `{key}` | `{default}` | {(sub.description or '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _rows(prefix: str, section: type[BaseModel]) -> list[str]:
    """One table row per key of `section`, a nested section's keys under its own name (`metrics.wandb.mode`)."""
    rows, defaults = [], section().model_dump(mode="json")
    for key, sub in section.model_fields.items():
        if isinstance(sub.annotation, type) and issubclass(sub.annotation, BaseModel):
            rows += _rows(f"{prefix}.{key}", sub.annotation)
            continue
        default = json.dumps(defaults[key])
        rows.append(f"| `{prefix}.{key}` | `{default}` | {(sub.description or '').replace('|', '/')} |")
    return rows


if __name__ == "__main__":
    print(render_reference(), end="")
