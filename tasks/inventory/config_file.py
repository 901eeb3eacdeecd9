"""The one YAML-to-model loader for every input file (`load_model`); every pydantic ValidationError becomes
one ConfigError line naming file, field and fix (`config_error`, also for a KL lane or a matrix arm)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tasks.inventory.base import ConfigError, _RefError
from tasks.inventory.safe_yaml import load_yaml

M = TypeVar("M", bound=BaseModel)

FIXES = {
    "missing": "add this field",
    "extra_forbidden": "remove it, or check its spelling against the documented fields in hosts.yaml",
    "literal_error": "use one of the allowed values",
    "int_parsing": "use a whole number",
    "int_type": "use a whole number",
    "float_parsing": "use a number",
    "string_pattern_mismatch": "write it in the documented form",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than_equal": "use a smaller value",
    "too_short": "give at least one entry",
    "dict_type": "write a mapping (key: value lines)",
    "list_type": "write a list (- item lines)",
    "bool_not_number": "write a number, not true/false",
    "string_type": "write text (quote it if YAML reads it as a number or true/false)",
    "float_type": "use a number",
    "union_tag_invalid": "use kind: counter or kind: capacity",
    "union_tag_not_found": "add 'kind: counter' or 'kind: capacity'",
}
_DEFAULT_FIX = "correct the value as the message says"
_UNION_TAGS = ("counter", "capacity")  # a gate's discriminated-union branch names
_TYPE_TAGS = ("int", "float", "str", "bool", "none")  # a plain union's branch names


def field_path(loc: tuple | list) -> str:
    """`lanes.x.gates[0].metric` from a pydantic location, union branch names left out."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif item in _UNION_TAGS and out.endswith("]") or item in _TYPE_TAGS or "[" in str(item):
            continue  # the union's branch, not a field
        else:
            out += ("." if out else "") + str(item)
    return out or "(top level)"


def config_error(path: str | Path, e: ValidationError, *, under: str = "",
                 fixes: Mapping[str, str] | None = None) -> ConfigError:
    """The first problem of `e` as one ConfigError line. `under`: where the validated mapping sits
    in the file (`arms[2]` for an arm's lane). `fixes`: fixes of this file's own, by error type
    or by `<top field>.<error type>` (checked first), over the shared ones."""
    err = e.errors()[0]
    loc = tuple(err["loc"])
    field = field_path(loc)
    ref = (err.get("ctx") or {}).get("error")
    if isinstance(ref, _RefError):
        # A field that starts with "." is relative to where the error was raised (a lane's own check).
        field, problem, fix = (field + ref.field if ref.field.startswith(".") else ref.field), ref.problem, ref.fix
    else:
        problem = err["msg"].removeprefix("Value error, ")
        if err["type"] == "bool_not_number":
            field = f"{field}.{err['ctx']['field']}" if field != "(top level)" else err["ctx"]["field"]
            problem = "a boolean (true/false) where a value belongs"
        own = fixes or {}
        top = next((str(x) for x in loc if not isinstance(x, int)), "")
        fix = own.get(f"{top}.{err['type']}") or own.get(err["type"]) or (
            f"use {err['ctx']['expected']}" if err["type"] == "literal_error" else FIXES.get(err["type"], _DEFAULT_FIX))
        if more := len(e.errors()) - 1:
            problem += f" (and {more} more problem{'s' if more > 1 else ''} after this one)"
    if under:
        field = under if field == "(top level)" else f"{under}.{field}"
    return ConfigError(path, field, problem, fix)


def validate(path: str | Path, model: type[M], data: Any, *, under: str = "",
             fixes: Mapping[str, str] | None = None, context: Mapping[str, Any] | None = None) -> M:
    """`model` from `data` (read from `path`); a ValidationError is one ConfigError line. `context`
    reaches the validators (the engine lookup a lane's draft plan needs)."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise config_error(path, e, under=under, fixes=fixes) from None


def load_model(path: str | Path, model: type[M], *, missing_fix: str, keys: str, example: str,
               fixes: Mapping[str, str] | None = None, context: Mapping[str, Any] | None = None) -> M:
    """A YAML config file as `model`: any problem (missing, unreadable, bad YAML, not a mapping,
    invalid field) is one ConfigError naming the file, the field and the fix."""
    raw = load_yaml(Path(path), missing_fix)
    if not isinstance(raw, dict):
        raise ConfigError(Path(path), "(top level)", f"must be a mapping with {keys}", f"start from {example}")
    return validate(Path(path), model, raw, fixes=fixes, context=context)
