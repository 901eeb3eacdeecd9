"""The YAML reader every input file goes through: bounded, strict, one ConfigError for any mistake.

Refused before parsing, with the line a person needs: a file too large (a 50 MB flag list once wrote
a 199 MB manifest and never exited), not regular, binary or not UTF-8, nested too deep, an alias bomb,
or a key written twice in one mapping (YAML silently keeps the last: a duplicated lane replaces the first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tasks.inventory.base import ConfigError

MAX_BYTES = 1 << 20  # 1 MiB: the shipped inventory is 8 KB
MAX_DEPTH = 64
MAX_NODES = 200_000  # after aliases are expanded


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, fix: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.fix, self.problem_mark = problem, fix, mark


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and nesting deeper than MAX_DEPTH."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels", "flatten the file: no configuration "
                               "needs that depth", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise _Refused("a mapping key that is itself a list or mapping", "use plain names as keys",
                               key_node.start_mark) from None
            if key in seen:
                raise _Refused(f"key {key!r} appears twice in one mapping (first at line {seen[key].line + 1})",
                               "keep one of them: YAML would silently keep only the last", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: Any) -> int:
    """How many nodes the document has once aliases are expanded (memoised: no bomb is walked)."""
    memo: dict[int, int] = {}

    def size(n: Any) -> int:
        if id(n) in memo:
            return memo[id(n)]
        memo[id(n)] = 1  # a cycle counts once
        total = 1
        if isinstance(n, yaml.SequenceNode):
            total += sum(size(c) for c in n.value)
        elif isinstance(n, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in n.value)
        memo[id(n)] = min(total, MAX_NODES + 1)
        return memo[id(n)]

    return size(node)


def read_text(path: Path, missing_fix: str) -> str:
    """The file's text, or one ConfigError: missing, not a regular file, too large, binary, not UTF-8."""
    if not path.exists():
        raise ConfigError(path, "(file)", "no such file", missing_fix)
    if not path.is_file():
        raise ConfigError(path, "(file)", "not a regular file (a directory, FIFO or device)", missing_fix)
    if (size := path.stat().st_size) > MAX_BYTES:
        raise ConfigError(path, "(file)", f"{size} bytes, more than the {MAX_BYTES} a configuration may have",
                          "keep configurations small (long flag or prompt lists belong in their own files)")
    with path.open("rb") as f:
        data = f.read(MAX_BYTES + 1)
    if b"\0" in data:
        raise ConfigError(path, "(file)", "a binary file, not YAML text", "pass the YAML text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(path, f"line {line}", f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})",
                          "save the file as UTF-8") from None


def load_yaml(path: Path, missing_fix: str) -> Any:
    """Parse one YAML document strictly; any problem is a ConfigError with line and column."""
    text = read_text(path, missing_fix)
    try:
        loader = StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            if _expanded_size(node) > MAX_NODES:
                raise _Refused(f"more than {MAX_NODES} values once its aliases are expanded",
                               "write the values out, without nested aliases")
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark, refused = getattr(e, "problem_mark", None), isinstance(e, _Refused)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(top level)" if refused else "(syntax)"
        if isinstance(e, _Refused):
            raise ConfigError(path, where, e.problem, e.fix) from None
        raise ConfigError(path, where, f"not valid YAML ({getattr(e, 'problem', None) or e})",
                          "fix the YAML syntax at that place") from None
    except RecursionError:
        raise ConfigError(path, "(structure)", "nested too deeply to read", "flatten the file") from None
