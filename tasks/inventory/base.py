"""What every input model shares: strict fields, the one-line config error, the command-line-safe patterns."""

from __future__ import annotations

import re
from pathlib import Path

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


# Values that end up on a command line are checked against these before they are quoted.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_SAFE_FLAG = re.compile(r"^[A-Za-z0-9_./:=,@+%{}\[\]\"' -]*$")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ConfigError(Exception):
    """A bad configuration: says which file, which field, and how to fix it."""

    def __init__(self, file: str | Path, field: str, problem: str, fix: str) -> None:
        problem, field = _one_line(problem), _one_line(field, 120)  # one line, whatever a parser said
        self.file, self.field, self.problem, self.fix = str(file), field, problem, fix
        super().__init__(f"{file}: {field}: {problem}. Fix: {fix}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: Any) -> Any:
        """`port: true` is not port 1: pydantic reads a bool as 0/1 where a number belongs; refused
        here (and in lists of numbers) unless the field itself may be a bool."""
        if not isinstance(data, dict):
            return data
        for name, v in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            if field is None or "bool" in repr(field.annotation):
                continue
            if any(isinstance(x, bool) for x in (v if isinstance(v, list) else [v])):
                raise PydanticCustomError("bool_not_number", "{field}: a boolean (true/false) where a value belongs",
                                          {"field": name})
        return data


class _RefError(ValueError):
    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(problem)
