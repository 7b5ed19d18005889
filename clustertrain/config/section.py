"""The base of every config section."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


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
