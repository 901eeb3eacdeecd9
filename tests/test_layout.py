"""The layout holds: one way down through the folders, no import circle, small modules and
functions, and engine differences asked of the `Engine`, not branched on by name.

Every import counts, module-level or inside a function or a TYPE_CHECKING block: a circle that
only a lazy import keeps from failing is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "flows", "lab")
LONG = 400  # lines; a longer module says why at its top ("Long because ...")
LONG_FUNCTION = 80  # lines, from `def` to its last line

# The folders, bottom first: a folder imports only from folders in tiers below its own (never
# from its own tier, never upwards). A folder is tasks/<folder>; flows/ and lab/ sit above tasks/.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("tasks.inventory",),   # hosts.yaml's models and loader, secrets, repository paths
    ("tasks.hosts",),       # transports, SSH, locks, files on a host
    ("tasks.wire",),        # request specs, stream events, replies, KL probes: what engines and client speak
    ("tasks.record",),      # the run folder, every table's row model, manifest, ledger, history
    ("tasks.engines",),     # one Engine per server, its capabilities and builds
    ("tasks.client",),      # load generation and request timing
    ("tasks.serving",),     # a lane's live server: Endpoint, handles, deadlines
    ("tasks.correctness",),  # smoke, needles, thinking, accuracy, tool gate
    ("tasks.stages",),      # a served lane's stages, preflight to safety
    ("tasks.report", "tasks.kl", "tasks.matrix"),  # report.md, the KL gate, the matrix
    ("lab",),
    ("flows",),
)
_BY_NAME = re.compile(r"((?:tasks|flows|lab)(?:\.\w+)+):\w+")
# The artifact-kind registry names each kind's row model as "module:Class": a string import that
# counts like any other. None is allowed: every row model lives in record/ or below it (wire/).
STRING_IMPORTS_ALLOWED: set[str] = set()
ENGINES = frozenset({"llamacpp", "sglang", "vllm"})
# None: the inventory's per-engine rules (rpc, nodes.env, draft plan, flag table) are data, one
# LaneRules row per engine (tasks/inventory/flag_conflicts.py), not branches on the name.
ENGINE_BRANCH_ALLOWED: set[str] = set()
LONG_FUNCTION_ALLOWED: set[str] = set()  # none: every function is under the bar


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path], package: tuple[str, ...] | None = None) -> set[str]:
    """Modules of ours that `path` imports: import statements anywhere (relative ones against
    `package`, by default the folder `path` is in), and "module:Name" strings (a registry that
    loads a class by name imports it all the same, only later)."""
    out: set[str] = set()
    if package is None and path.is_relative_to(ROOT):
        package = path.relative_to(ROOT).parts[:-1]
    registry = path.is_relative_to(ROOT) and str(path.relative_to(ROOT)) in STRING_IMPORTS_ALLOWED
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level and package is not None:
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and not registry \
                and (named := _BY_NAME.fullmatch(node.value)):
            names = [named.group(1)]
        else:
            continue
        for name in names:
            # the longest prefix that is one of ours: `tasks.kl.gate.run` -> `tasks.kl.gate`; a name
            # taken from a folder's __init__ (`from tasks.engines import engine_for`) is an arrow to it
            parts = name.split(".")
            for i in range(len(parts), 1, -1):
                candidate = ".".join(parts[:i])
                if candidate in modules:
                    out.add(candidate)
                    break
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _circles(graph) == []


def _folder(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tasks" and len(parts) > 1 else parts[0]


def _folder_graph() -> dict[str, dict[str, list[str]]]:
    """{folder: {folder it imports: [the module arrows behind it]}}."""
    modules = _modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        for target in _imports(path, modules):
            if _folder(target) != _folder(name):
                graph.setdefault(_folder(name), {}).setdefault(_folder(target), []).append(f"{name} -> {target}")
    return graph


def _up_arrows(graph: dict[str, dict[str, list[str]]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Arrows to a folder in the same tier or above, and folders the layer order does not place."""
    tier = {folder: i for i, row in enumerate(layers) for folder in row}
    out = [f"{f}: not in LAYERS" for f in sorted({*graph, *(t for e in graph.values() for t in e)}) if f not in tier]
    for source, targets in sorted(graph.items()):
        for target, arrows in sorted(targets.items()):
            if source in tier and target in tier and tier[target] >= tier[source]:
                out += arrows
    return out


def test_no_folder_circle():
    graph = _folder_graph()
    assert _circles({f: set(t) for f, t in graph.items()}) == []


def test_every_arrow_runs_down_the_layers():
    assert _up_arrows(_folder_graph(), LAYERS) == []


def test_a_planted_up_arrow_is_found():
    graph = {"tasks.record": {"tasks.hosts": ["tasks.record.a -> tasks.hosts.b"]},
             "tasks.hosts": {"tasks.record": ["tasks.hosts.lock -> tasks.record.x"]},
             "tasks.kl": {"tasks.matrix": ["tasks.kl.y -> tasks.matrix.z"]}, "tasks.new": {}}
    assert _up_arrows(graph, LAYERS) == ["tasks.new: not in LAYERS", "tasks.hosts.lock -> tasks.record.x",
                                         "tasks.kl.y -> tasks.matrix.z"]


def _engine_branches(tree: ast.AST) -> list[int]:
    """Lines comparing with an engine's name: `== "vllm"`, `!= "llamacpp"`, `in ("sglang", ...)`,
    `case "vllm":`."""
    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in ENGINES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in node.elts)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and named(node.value):
            lines.append(node.lineno)
    return lines


def test_no_engine_name_branch_outside_engines():
    """A difference between engines is a capability of `Engine` (tasks/engines/base.py)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith("tasks/engines/") or rel in ENGINE_BRANCH_ALLOWED:
                continue
            found += [f"{rel}:{line}" for line in _engine_branches(ast.parse(path.read_text()))]
    assert found == []


def test_a_planted_engine_branch_is_found():
    code = ('if lane.engine == "llamacpp": pass\nok = engine.pinned_build\nx = e in ("vllm", "sglang")\n'
            'match e:\n    case "sglang": pass\n')
    assert _engine_branches(ast.parse(code)) == [1, 3, 5]


def _long_functions(tree: ast.AST, rel: str) -> list[str]:
    return [f"{rel}:{node.name}" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > LONG_FUNCTION]


def test_no_function_is_long():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += _long_functions(ast.parse(path.read_text()), str(path.relative_to(ROOT)))
    assert sorted(set(found) - LONG_FUNCTION_ALLOWED) == []


def test_a_planted_long_function_is_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(LONG_FUNCTION))
    assert _long_functions(ast.parse(f"def short():\n    pass\n\n\ndef long():\n{body}\n"), "m.py") == ["m.py:long"]


def test_a_class_loaded_by_name_counts_as_an_import(tmp_path):
    planted = tmp_path / "registry.py"
    planted.write_text('KINDS = {"verdict": "tasks.matrix.verdict:VerdictRow", "note": "tasks: a word"}\n'
                       'def f():\n    from tasks.hosts import files\n    from tasks.engines import engine_for\n')
    assert _imports(planted, _modules()) == {"tasks.matrix.verdict", "tasks.hosts.files", "tasks.engines"}


def test_a_relative_import_counts_as_an_import(tmp_path):
    planted = tmp_path / "api_key.py"
    planted.write_text("from ..engines import engine_for\nfrom . import secrets\nfrom .base import ConfigError\n")
    assert _imports(planted, _modules(), package=("tasks", "inventory")) == {
        "tasks.engines", "tasks.inventory.secrets", "tasks.inventory.base"}


def test_a_planted_circle_is_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_tasks_modules_are_small_or_say_why():
    long = []
    for path in (ROOT / "tasks").rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > LONG and "Long because" not in text[:2000]:
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert long == []


def test_tasks_is_grouped_by_domain():
    """Only packages under tasks/, one concern a folder: a newcomer finds a stage by its folder name."""
    loose = sorted(p.name for p in (ROOT / "tasks").glob("*.py") if p.name != "__init__.py")
    assert loose == []


def test_importing_lanebench_patches_nothing():
    """Importing any module of tasks/, flows/ or lab/ leaves Prefect as it is: the redaction of what
    lanebench hands Prefect is installed by an explicit call (a flow command, `served_lane`)."""
    names = [m for m in _modules() if not m.endswith("__main__")]
    code = ("import importlib, sys, logging\n"
            f"for m in {names!r}: importlib.import_module(m)\n"
            "from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient\n"
            "from prefect.events.clients import EventsClient\n"
            "sends = [PrefectHttpxAsyncClient.send, PrefectHttpxSyncClient.send, EventsClient.emit]\n"
            "print(sorted({f.__module__ for f in sends}))\n"
            "filters = [f for h in logging.getLogger('prefect').handlers for f in h.filters]\n"
            "print([type(f).__name__ for f in filters])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["['prefect.client.base', 'prefect.events.clients']", "[]"]
