"""Every Prefect task takes (and returns) only values Prefect can describe in its UI.

docs/architecture.md: "nothing in a task's inputs that Prefect cannot describe". A task's
parameters are what its task run shows and what a retry replays, so they are plain values:
str, int, float, bool, paths, enums and Literals, pydantic models (whose fields are such values
too), and lists, dicts, tuples and Optionals of those. A live server, a run folder object, a
transport or a callback stays in the process that serves the lane (tasks/serving/live.py) and is
looked up there by name.

Every module under tasks/ and flows/ is imported and every `prefect.tasks.Task` found is checked
through `typing.get_type_hints` on its function.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import types
import typing
from pathlib import Path, PurePath

from prefect.tasks import Task
from pydantic import BaseModel

from conftest import REPO

_PLAIN = (str, int, float, bool, bytes, type(None))
_CONTAINERS = (list, dict, tuple, set, frozenset)


def _modules() -> list[str]:
    names = []
    for package in ("tasks", "flows"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__main__":  # running it is the CLI itself
                continue
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


def _tasks() -> dict[str, Task]:
    found: dict[str, Task] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, Task) and getattr(value.fn, "__module__", None) == name:
                found[f"{name}.{attr}"] = value
    return found


def problems(annotation: object, where: str, in_model: bool = False, seen: set[type] | None = None) -> list[str]:
    """Why `annotation` is not a value Prefect can describe ([] when it is)."""
    seen = set() if seen is None else seen
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is typing.Any:
        # A pydantic field may hold JSON (`dict[str, Any]`): pydantic validates and dumps it. As a
        # task's own parameter `Any` says nothing of what is passed.
        return [] if in_model else [f"{where}: Any"]
    if annotation in _PLAIN or annotation is type(None):
        return []
    if origin is typing.Annotated:
        return problems(args[0], where, in_model, seen)
    if origin is typing.Literal:
        return []
    if origin in (typing.Union, types.UnionType):
        return [p for a in args for p in problems(a, where, in_model, seen)]
    if origin in _CONTAINERS:
        return [p for a in args if a is not Ellipsis for p in problems(a, where, in_model, seen)]
    if annotation in _CONTAINERS:  # bare list/dict: of whatever
        return [] if in_model else [f"{where}: bare {annotation.__name__} (say what it holds)"]
    if origin is not None:
        return [f"{where}: {annotation!r}"]  # Callable[...], Iterator[...], type[...], ...
    if isinstance(annotation, type):
        if issubclass(annotation, (PurePath, enum.Enum)):
            return []
        if issubclass(annotation, BaseModel):
            if annotation in seen:
                return []
            seen.add(annotation)
            hints = typing.get_type_hints(annotation, include_extras=True)
            return [p for field in annotation.model_fields
                    for p in problems(hints.get(field, typing.Any), f"{where} -> {annotation.__name__}.{field}",
                                      True, seen)]
        kind = "a dataclass" if dataclasses.is_dataclass(annotation) else "a class"
        return [f"{where}: {annotation.__module__}.{annotation.__qualname__} is {kind}, not a value Prefect can "
                "describe"]
    return [f"{where}: {annotation!r}"]


def test_the_checker_tells_values_from_live_objects() -> None:
    from collections.abc import Callable

    from tasks.hosts.transport import Transport
    from tasks.inventory.models import Lane
    from tasks.record.run_folder import RunFolder

    @dataclasses.dataclass
    class Handle:
        x: int

    good = [str, int | None, Path, Lane, list[tuple[int, str, int]], dict[str, list[Lane]],
            typing.Literal["all", "tools"], tuple[Path, ...]]
    bad = [Callable[[int], None], RunFolder, Transport, Handle, list[Handle], Handle | None, typing.Any,
           dict[str, Callable[[], None]]]
    assert [g for g in good if problems(g, "x")] == []
    assert [b for b in bad if not problems(b, "x")] == []


def test_every_task_takes_and_returns_describable_values() -> None:
    tasks = _tasks()
    # Every stage of the lane is a task; if this shrinks, the scan lost its way.
    assert {"tasks.stages.decode_curve.decode_curve", "tasks.stages.boot.boot", "flows.lanes.host_queue",
            "tasks.correctness.tool_gate.tool_gate"} <= set(tasks), sorted(tasks)
    found = []
    for name, task in sorted(tasks.items()):
        hints = typing.get_type_hints(task.fn, include_extras=True)
        for param in inspect.signature(task.fn).parameters.values():
            if param.name not in hints:
                found.append(f"{name}({param.name}): no annotation")
                continue
            found += problems(hints[param.name], f"{name}({param.name})")
        if "return" in hints:
            found += problems(hints["return"], f"{name} -> return")
    assert not found, "task inputs Prefect cannot describe:\n" + "\n".join(found)
