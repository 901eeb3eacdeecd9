"""The tool-call grader: AST-style checks of a server's structured `tool_calls` against possible answers.

Suites are BFCL-shaped (toolsuites/README.md): per expected call the acceptable values of each
parameter (`""` among them: it may be left out). The checks follow BFCL's AST checker, and every
miss is put in exactly one kind:

    http_error          the request was refused or failed (the protocol never retries)
    truncated           the reply hit max_tokens before a complete call came back
    no_call             a complete reply without any structured call (text instead)
    malformed_call      a call whose arguments are not a JSON object
    wrong_count         more or fewer calls than expected
    wrong_function      a call of another function than expected
    missing_argument    a required parameter, or one the answer needs, left out
    unexpected_argument a parameter the function does not take, or the answer does not allow
    wrong_value         a value (or its type) outside the acceptable ones

BFCL's rules (bfcl_eval/eval_checker/ast_eval/ast_checker.py): an int is accepted for a float;
strings compare after `standardize`, lists element-wise, dicts key by key; a value of another type
than the schema's is compared when it has the answers' type ("variable" case). Function names
compare after OpenAI-style sanitisation (`math.gcd` answered as `math_gcd`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tasks.inventory.config_file import config_error
from tasks.wire.replies import ChatReply

MissKind = Literal["http_error", "truncated", "no_call", "malformed_call", "wrong_count", "wrong_function",
                   "missing_argument", "unexpected_argument", "wrong_value"]
MISS_KINDS: tuple[str, ...] = MissKind.__args__  # type: ignore[attr-defined]
MISS_LABELS: dict[str, str] = {
    "http_error": "HTTP error", "truncated": "truncated", "no_call": "no call", "malformed_call": "malformed call",
    "wrong_count": "wrong call count", "wrong_function": "wrong function", "missing_argument": "missing argument",
    "unexpected_argument": "unexpected argument", "wrong_value": "wrong argument value",
}

Category = Literal["simple", "multiple", "parallel", "parallel_multiple"]


class ToolCase(BaseModel):
    """One suite line: BFCL's question and function entries plus its possible answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    category: Category
    question: list[list[dict[str, Any]]]
    function: list[dict[str, Any]]
    ground_truth: list[dict[str, dict[str, list[Any]]]]

    @model_validator(mode="after")
    def _consistent(self) -> ToolCase:
        if len(self.question) != 1 or not self.question[0]:
            raise ValueError("question must hold exactly one turn of messages (multi-turn suites are not graded here)")
        names = {f.get("name") for f in self.function}
        if not self.function or None in names:
            raise ValueError("function must list at least one definition, each with a name")
        if not self.ground_truth or any(len(call) != 1 for call in self.ground_truth):
            raise ValueError("ground_truth must list expected calls, each as {function name: {parameter: [values]}}")
        if self.category == "simple" and (len(self.function) != 1 or len(self.ground_truth) != 1):
            raise ValueError("a simple case offers one function and expects one call")
        if self.category == "multiple" and len(self.ground_truth) != 1:
            raise ValueError("a multiple case expects one call among several functions")
        for call in self.ground_truth:
            (name, params), = call.items()
            if name not in names:
                raise ValueError(f"ground_truth calls {name!r}, which is not among the functions")
            props = _function(self.function, name).get("parameters", {}).get("properties", {})
            for param, values in params.items():
                if param not in props:
                    raise ValueError(f"ground_truth names parameter {param!r}, which {name} does not take")
                if not isinstance(values, list) or not values:
                    raise ValueError(f"ground_truth {name}.{param} must be a non-empty list of acceptable values")
        return self

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.question[0]


class Verdict(BaseModel):
    """The grade of one reply: solved, or the one kind of miss and what exactly was wrong."""

    model_config = ConfigDict(extra="forbid")
    solved: bool
    kind: MissKind | None = None
    detail: str = ""


def load_suite(path: str | Path) -> list[ToolCase]:
    """Read a JSONL suite; any bad line is a ValueError naming the line."""
    cases: list[ToolCase] = []
    seen: set[str] = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            case = ToolCase.model_validate(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"line {n}: not JSON ({e.msg})") from None
        except ValidationError as e:
            bad = config_error(path, e)
            raise ValueError(f"line {n}: {'' if bad.field == '(top level)' else bad.field + ': '}{bad.problem}") from None
        if case.id in seen:
            raise ValueError(f"line {n}: id {case.id!r} appears twice")
        seen.add(case.id)
        cases.append(case)
    if not cases:
        raise ValueError("the suite has no cases")
    return cases


def merge_bfcl(questions: str | Path, answers: str | Path, category: Category) -> list[dict[str, Any]]:
    """BFCL's two files (questions with functions; possible answers) -> suite lines of one category."""
    def rows(path: str | Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

    truth = {row["id"]: row["ground_truth"] for row in rows(answers)}
    return [{"id": row["id"], "category": category, "question": row["question"], "function": row["function"],
             "ground_truth": truth[row["id"]]} for row in rows(questions)]


# --- What is sent: OpenAI tools from BFCL definitions ----------------------------------------

# BFCL writes Python-ish type names; OpenAI-compatible servers want JSON Schema (BFCL's own
# OpenAI handler maps them the same way).
_TO_JSON_SCHEMA = {"dict": "object", "float": "number", "tuple": "array", "any": "string", "list": "array",
                   "bool": "boolean", "int": "integer"}


def wire_name(name: str) -> str:
    """A function name as OpenAI-style servers accept it (^[a-zA-Z0-9_-]{1,64}$)."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name)[:64]


def _json_schema(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    def converted(key: str, value: Any) -> Any:
        if key == "type" and isinstance(value, str):
            return _TO_JSON_SCHEMA.get(value, value)
        if key == "properties" and isinstance(value, dict):
            return {k: _json_schema(v) for k, v in value.items()}
        return _json_schema(value) if key in ("items", "additionalProperties") else value

    return {key: converted(key, value) for key, value in schema.items()}


def openai_tools(case: ToolCase, strict: bool = False) -> list[dict[str, Any]]:
    """The case's functions as an OpenAI `tools` list; `strict` only when the protocol says so."""
    return [{"type": "function", "function": {
        "name": wire_name(f["name"]), "description": f.get("description", ""),
        "parameters": _json_schema(f.get("parameters", {"type": "object", "properties": {}})),
        **({"strict": True} if strict else {})}} for f in case.function]


# --- Grading ------------------------------------------------------------------------------------


def grade(case: ToolCase, reply: ChatReply) -> Verdict:
    """One reply against one case; the first problem found decides the kind of miss."""
    if not reply.ok:
        status = f"HTTP {reply.http_status}" if reply.http_status else "no HTTP answer"
        return _miss("http_error", f"{status}: {(reply.error or '')[:200]}")
    cut = reply.finish_reason == "length"
    if not reply.tool_calls:
        text = json.dumps(reply.content[:120])
        if cut:
            return _miss("truncated", f"max_tokens reached before any call; content {text}")
        return _miss("no_call", f"no structured call (finish_reason={reply.finish_reason}); content {text}")
    calls: list[tuple[str, dict[str, Any]]] = []
    for call in reply.tool_calls:
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            if cut:
                return _miss("truncated", f"max_tokens reached inside the call {call.name}({call.arguments[:80]}")
            return _miss("malformed_call", f"{call.name}: arguments are not a JSON object: {call.arguments[:120]!r}")
        calls.append((call.name, args))
    if len(calls) != len(case.ground_truth):
        return _miss("wrong_count", f"{len(calls)} call{'s' if len(calls) != 1 else ''} ({', '.join(n for n, _ in calls)}), "
                                    f"expected {len(case.ground_truth)}")
    if case.category in ("simple", "multiple"):
        return _check_call(case.function, case.ground_truth[0], calls[0])
    return _check_unordered(case, calls)


def _check_unordered(case: ToolCase, calls: list[tuple[str, dict[str, Any]]]) -> Verdict:
    """Parallel categories: every expected call must match a distinct actual call, in any order."""
    left = list(range(len(calls)))
    for expected in case.ground_truth:
        (name, _), = expected.items()
        misses = []
        for i in left:
            verdict = _check_call(case.function, expected, calls[i])
            if verdict.solved:
                left.remove(i)
                break
            misses.append(verdict)
        else:
            # Report the most telling miss: one on a call of the right function if there is one.
            named = [v for v in misses if v.kind != "wrong_function"]
            return (named or misses)[0]
    return Verdict(solved=True)


def _check_call(functions: list[dict[str, Any]], expected: dict[str, dict[str, list[Any]]],
                call: tuple[str, dict[str, Any]]) -> Verdict:
    (name, possible), = expected.items()
    got_name, args = call
    if got_name not in (name, wire_name(name)):
        return _miss("wrong_function", f"called {got_name}, expected {wire_name(name)}")
    params = _function(functions, name).get("parameters", {})
    props: dict[str, Any] = params.get("properties", {})
    for param in params.get("required", []):
        if param not in args:
            return _miss("missing_argument", f"{name}: required parameter {param!r} missing")
    for param, value in args.items():
        if param not in props or param not in possible:
            return _miss("unexpected_argument", f"{name}: unexpected parameter {param!r}={value!r}")
        problem = _check_value(value, props[param], possible[param])
        if problem:
            return _miss("wrong_value", f"{name}.{param}: {problem}")
    for param, values in possible.items():
        if param not in args and "" not in values:
            return _miss("missing_argument", f"{name}: parameter {param!r} left out, and the answer needs it")
    return Verdict(solved=True)


def _function(functions: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(f for f in functions if f.get("name") == name)


def _miss(kind: str, detail: str) -> Verdict:
    return Verdict(solved=False, kind=kind, detail=detail)


_PY_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "float": float, "number": float, "boolean": bool, "array": list,
    "tuple": list, "list": list, "dict": dict, "object": dict,
}


def standardize(text: str) -> str:
    """BFCL's string normalisation: no spaces or `,./-_*^`, lower case, `'` as `"`."""
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def _same_type(value: Any, wanted: type | tuple[type, ...]) -> bool:
    # bool is an int to Python; a JSON true is never an acceptable integer or number.
    if isinstance(value, bool):
        return wanted is bool
    return isinstance(value, wanted)


def _check_value(value: Any, schema: dict[str, Any], possible: list[Any]) -> str | None:
    """None when `value` is acceptable, else what is wrong with it."""
    type_name = str(schema.get("type", "any"))
    if type_name in ("float", "number") and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # an int is accepted for a float
    wanted = _PY_TYPES.get(type_name)
    answers = [p for p in possible if p != ""]
    # BFCL's "variable" case: a value of the answers' type is compared whatever the schema says.
    if wanted is not None and not _same_type(value, wanted) and not (answers and type(value) is type(answers[0])):
        return f"type {type(value).__name__} ({value!r}), expected {type_name}"
    if isinstance(value, dict):
        return _check_dict(value, answers)
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            return _check_list_of_dicts(value, answers)
        norm = [standardize(v) if isinstance(v, str) else v for v in value]
        options = [[standardize(v) if isinstance(v, str) else v for v in p] for p in answers if isinstance(p, list)]
        return None if norm in options else f"{value!r} not among {answers}"
    return None if _member(value, answers) else f"{value!r} not among {answers}"


def _equal(value: Any, answer: Any) -> bool:
    """Numbers compare by value (5 == 5.0); a boolean only equals a boolean."""
    if isinstance(value, bool) or isinstance(answer, bool):
        return type(value) is type(answer) and value == answer
    return bool(value == answer)


def _check_dict(value: dict[str, Any], answers: list[Any]) -> str | None:
    """None when `value` matches one of the dict answers, else what is wrong against the last one."""
    problems = [_dict_problem(value, a) for a in answers if isinstance(a, dict)]
    return None if None in problems else problems[-1] if problems else f"{value!r} not among {answers}"


def _dict_problem(value: dict[str, Any], answer: dict[str, list[Any]]) -> str | None:
    if extra := [k for k in value if k not in answer]:
        return f"unexpected key {extra[0]!r} in {value!r}"
    if bad := [k for k, v in value.items() if not _member(v, answer[k])]:
        return f"key {bad[0]!r}={value[bad[0]]!r} not among {answer[bad[0]]}"
    if missing := [k for k, vs in answer.items() if k not in value and "" not in vs]:
        return f"key {missing[0]!r} missing from {value!r}"
    return None


def _member(value: Any, options: list[Any]) -> bool:
    if isinstance(value, str):
        return standardize(value) in [standardize(o) for o in options if isinstance(o, str)]
    return any(_equal(value, o) for o in options)


def _check_list_of_dicts(value: list[dict[str, Any]], answers: list[Any]) -> str | None:
    problem = f"{value!r} not among {answers}"
    for answer in answers:
        if not isinstance(answer, list) or len(answer) != len(value):
            continue
        problems = [_check_dict(v, [a]) for v, a in zip(value, answer)]
        if not any(problems):
            return None
        problem = next(p for p in problems if p)
    return problem
