"""The base of every config section, and the type of every path key (`ConfigPath`)."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, field_validator

_VARIABLE = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")  # $NAME or ${NAME}; any other $ is kept


def expand_path(value: Any) -> Any:
    """A path of a config with `$VAR`, `${VAR}` and a leading `~` expanded, as the shell would, from the
    environment of the process that reads it (the LoRA walkthrough keeps everything under `$SCRATCH_ROOT/...`).

    Raises:
        ValueError: a variable that is unset or empty (a path made of it would start at `/`), by name.
    """
    if not isinstance(value, str):
        return value

    def variable(match: re.Match[str]) -> str:
        name = match.group(1) if match.group(1) is not None else match.group(2)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"${{{name}}} is not an environment variable's name")
        if not os.environ.get(name):
            raise ValueError(f"${name} is {'empty' if name in os.environ else 'not set'} in this environment; export "
                             "it, or write the path out")
        return os.environ[name]

    expanded = _VARIABLE.sub(variable, value)
    return os.path.expanduser(expanded) if expanded.startswith("~") else expanded


ConfigPath = Annotated[str, BeforeValidator(expand_path)]
"""A path key's type: every file, folder and glob a config names, expanded once, where it is read."""


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits true/false (bool itself, or a union or Literal holding it)."""
    if annotation is bool or annotation in (True, False):
        return True
    return any(_takes_bool(arg) for arg in get_args(annotation) if not isinstance(arg, str))


class Section(BaseModel):
    """Base of every section: unknown keys are errors, true/false is never taken for a number (pydantic would
    read `steps: true` as 1), and a validated config is frozen: it is read, never written (RunConfig.updated
    derives another)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        items = value if isinstance(value, (list, tuple)) else [value]  # [true, 3] for a pair of numbers too
        if any(isinstance(v, bool) for v in items) and not _takes_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError("true/false is not allowed here; give a value of the field's own type")
        return value
