"""The one YAML-to-model loader: every input file (inventory, KL, matrix) is read here, and every
mistake in it becomes one line naming file, field and fix."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from tasks.inventory import secrets
from tasks.inventory.base import ConfigError, _RefError
from tasks.inventory.models import Inventory
from tasks.inventory.paths import REPO
from tasks.inventory.safe_yaml import load_yaml


_FIXES = {
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


def _field_path(loc: tuple) -> str:
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif item in ("counter", "capacity") and out.endswith("]"):
            continue  # the discriminated union's branch name, not a field
        else:
            out += ("." if out else "") + str(item)
    return out or "(top level)"


def read_yaml_mapping(path: Path, missing_fix: str, keys: str, example: str) -> dict:
    """A YAML file that must hold a mapping: a missing file, a syntax error (with its line and
    column) or another top-level shape is one ConfigError, for every lanebench input file."""
    raw = load_yaml(path, missing_fix)
    if not isinstance(raw, dict):
        raise ConfigError(path, "(top level)", f"must be a mapping with {keys}", f"start from {example}")
    return raw


def load_inventory(path: str | Path) -> Inventory:
    """Read and validate an inventory file; any problem is one ConfigError."""
    path = Path(path)
    raw = read_yaml_mapping(path, "pass an existing file with --hosts, or run without --hosts for the rehearsal lane",
                            "'hosts' and 'lanes'", "the shipped hosts.yaml")
    try:
        inventory = Inventory.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _RefError):
            # A field that starts with "." is relative to where the error was raised (a lane's own check).
            where = _field_path(tuple(err["loc"])) + ctx_err.field if ctx_err.field.startswith(".") else ctx_err.field
            raise ConfigError(path, where, ctx_err.problem, ctx_err.fix) from None
        field = _field_path(tuple(err["loc"]))
        problem = err["msg"].removeprefix("Value error, ")
        if err["type"] == "bool_not_number":
            field = f"{field}.{err['ctx']['field']}" if field != "(top level)" else err["ctx"]["field"]
            problem = "a boolean (true/false) where a value belongs"
        if err["type"] == "literal_error":
            fix = f"use {err['ctx']['expected']}"
        else:
            fix = _FIXES.get(err["type"], "correct the value as the message says")
        more = len(e.errors()) - 1
        if more:
            problem += f" (and {more} more problem{'s' if more > 1 else ''} after this one)"
        raise ConfigError(path, field, problem, fix) from None
    secrets.remember(inventory)  # scrubbed from whatever this process says about any lane from now on
    return inventory


def shipped_or_local(base: Path, rel: str) -> Path:
    """A file the inventory names: relative to the inventory's folder; a relative path missing
    there is looked up in the lanebench checkout, so the shipped tool suites, protocol and chat
    templates work from an inventory kept anywhere."""
    p = Path(rel)
    if p.is_absolute():
        return p
    local = (base / p).resolve()
    if not local.exists() and (REPO / p).exists():
        return (REPO / p).resolve()
    return local
