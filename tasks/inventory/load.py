"""The one YAML-to-model loader: every input file (inventory, KL, matrix) is read here, and every
mistake in it becomes one line naming file, field and fix."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from tasks.inventory.base import ConfigError, _RefError
from tasks.inventory.models import Inventory, Lane, load_protocol


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
    if not path.is_file():
        raise ConfigError(path, "(file)", "no such file", missing_fix)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(syntax)"
        raise ConfigError(path, where, f"not valid YAML ({getattr(e, 'problem', e)})", "fix the YAML syntax at that place") from None
    if not isinstance(raw, dict):
        raise ConfigError(path, "(top level)", f"must be a mapping with {keys}", f"start from {example}")
    return raw


def load_inventory(path: str | Path) -> Inventory:
    """Read and validate an inventory file; any problem is one ConfigError."""
    path = Path(path)
    raw = read_yaml_mapping(path, "pass an existing file with --hosts, or run without --hosts for the rehearsal lane",
                            "'hosts' and 'lanes'", "the shipped hosts.yaml")
    try:
        return Inventory.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _RefError):
            raise ConfigError(path, ctx_err.field, ctx_err.problem, ctx_err.fix) from None
        field = _field_path(tuple(err["loc"]))
        problem = err["msg"].removeprefix("Value error, ")
        if err["type"] == "literal_error":
            fix = f"use {err['ctx']['expected']}"
        else:
            fix = _FIXES.get(err["type"], "correct the value as the message says")
        more = len(e.errors()) - 1
        if more:
            problem += f" (and {more} more problem{'s' if more > 1 else ''} after this one)"
        raise ConfigError(path, field, problem, fix) from None


REPO_DIR = Path(__file__).resolve().parents[2]


def shipped_or_local(base: Path, rel: str) -> Path:
    """A file the inventory names: relative to the inventory's folder; a relative path missing
    there is looked up in the lanebench checkout, so the shipped tool suites, protocol and chat
    templates work from an inventory kept anywhere."""
    p = Path(rel)
    if p.is_absolute():
        return p
    local = (base / p).resolve()
    if not local.exists() and (REPO_DIR / p).exists():
        return (REPO_DIR / p).resolve()
    return local


def check_prompt_files(inventory: Inventory, path: str | Path) -> None:
    """Prompt sets are input, not preconditions: a missing one is a ConfigError before anything runs.

    So are the correctness gates' inputs: chat template, tool suites and tool protocol must exist
    and parse (a bad suite line is named by line number).
    """
    base = Path(path).resolve().parent
    for name, lane in inventory.lanes.items():
        files = {f"lanes.{name}.bench.decode.prompts": lane.bench.decode.prompts}
        if lane.bench.acceptance is not None:
            files |= {f"lanes.{name}.bench.acceptance.classes.{c}": p for c, p in lane.bench.acceptance.classes.items()}
        if lane.bench.prefill is not None and lane.bench.prefill.prompts is not None:
            files |= {f"lanes.{name}.bench.prefill.prompts": lane.bench.prefill.prompts}
        for field, rel in files.items():
            target = Path(rel) if Path(rel).is_absolute() else base / rel
            if not target.is_file():
                raise ConfigError(path, field, f"prompt file {target} does not exist",
                                  "point it at a JSONL file of {id, class, prompt} lines (paths are relative to this file)")
    for name, lane in inventory.lanes.items():
        _check_correctness_files(name, lane, base, path)


def _check_correctness_files(name: str, lane: Lane, base: Path, path: str | Path) -> None:
    from tasks.correctness.accuracy import load_mcq
    from tasks.correctness.tool_grader import load_suite

    checks: list[tuple[str, str, object, str]] = []
    if lane.bench.accuracy is not None:
        checks.append((f"lanes.{name}.bench.accuracy.file", lane.bench.accuracy.file, load_mcq,
                       "point it at a JSONL file of {question, choices, answer} lines (GPQA-Diamond's shape), "
                       "e.g. testbed/evals/mcq.jsonl"))
    if lane.agentic is not None and lane.agentic.chat_template is not None:
        checks.append((f"lanes.{name}.agentic.chat_template", lane.agentic.chat_template, None,
                       "point it at a Jinja chat template file (e.g. testbed/chat/testbed.jinja)"))
    plan = lane.correctness.tool_gate if lane.correctness else None
    if plan is not None:
        fix = "point it at a tool suite in the JSONL format of toolsuites/README.md"
        checks.append((f"lanes.{name}.correctness.tool_gate.dev", plan.dev, load_suite, fix))
        if plan.held_out is not None:
            checks.append((f"lanes.{name}.correctness.tool_gate.held_out", plan.held_out, load_suite, fix))
        checks.append((f"lanes.{name}.correctness.tool_gate.protocol", plan.protocol, load_protocol,
                       "point it at a protocol file like toolsuites/protocol.yaml"))
    for field, rel, loader, fix in checks:
        target = shipped_or_local(base, rel)
        if not target.is_file():
            raise ConfigError(path, field, f"file {target} does not exist", fix + " (paths are relative to this file)")
        if loader is not None:
            try:
                loader(target)  # type: ignore[operator]
            except ValueError as e:
                raise ConfigError(path, field, f"{target}: {e}", fix) from None
