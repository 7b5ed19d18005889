"""`clustertrain config keys` lists every key of the schema, with its type, default and help."""

from __future__ import annotations

import re

import pytest
from pydantic import BaseModel

from clustertrain.cli import main
from clustertrain.config.schema import RunConfig


def walked(model: type[BaseModel] = RunConfig, prefix: str = "") -> set[str]:
    """The schema's keys, walked here on their own: a section's keys are its fields, a list of sections's those
    of its items (`.N.`)."""
    keys = set()
    for name, field in model.model_fields.items():
        name = field.alias or name
        inner = [t for t in (field.annotation, *getattr(field.annotation, "__args__", ())) if t is not type(None)]
        inner += [a for t in inner for a in getattr(t, "__args__", ())]
        section = next((t for t in inner if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if section is None:
            keys.add(prefix + name)
        elif "list" in str(field.annotation):
            keys |= {prefix + name} | walked(section, f"{prefix}{name}.N.")
        else:
            keys |= walked(section, f"{prefix}{name}.")
    return keys


def listed(capsys, *section: str) -> dict[str, str]:
    assert main(["config", "keys", *section]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if not line.startswith("    ")]
    return {m.group(1): m.group(2) for m in (re.fullmatch(r"(\S+): (.+)", line) for line in heads)}


def test_every_schema_key_is_listed_once_with_type_and_default(capsys):
    keys = listed(capsys)
    assert set(keys) == walked()
    assert keys["optim.lr"] == "float = 0.003"
    assert keys["parallel.strategy"] == 'ddp|zero2|zero3|hybrid_zero2|hybrid_zero3|auto = "ddp"'
    assert keys["checkpoint.async"] == 'bool | auto = "auto"'
    assert keys["data.sources.N.weight"] == "float = 1.0"
    assert keys["train.steps"] == "int | null = 300"


def test_a_section_lists_its_keys_with_help(capsys):
    assert main(["config", "keys", "checkpoint"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["checkpoint.every: int = 100", "    Save every N steps (0: only at the end)."]
    assert set(listed(capsys, "data.sources")) == {k for k in walked() if k.startswith("data.sources")}


def test_an_unknown_section_is_one_line_with_close_names(capsys):
    assert main(["config", "keys", "optm"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: config keys optm: no such section or key (did you mean optim, optim.lr, optim.eps?)"


@pytest.mark.parametrize("command", [["train"], ["config", "check"], ["plan"], ["slurm", "render"]])
def test_the_help_of_a_command_that_takes_a_config_names_the_key_flags(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--section.key VALUE" in help_text and "`clustertrain config keys`" in help_text
