"""What every input model shares: strict fields, the one-line config error, the command-line-safe patterns."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict


# Values that end up on a command line are checked against these before they are quoted.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_SAFE_FLAG = re.compile(r"^[A-Za-z0-9_./:=,@+%{}\[\]\"' -]*$")


class ConfigError(Exception):
    """A bad configuration: says which file, which field, and how to fix it."""

    def __init__(self, file: str | Path, field: str, problem: str, fix: str) -> None:
        self.file, self.field, self.problem, self.fix = str(file), field, problem, fix
        super().__init__(f"{file}: {field}: {problem}. Fix: {fix}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _RefError(ValueError):
    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(problem)
