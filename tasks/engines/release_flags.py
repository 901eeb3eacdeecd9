"""The launch flags a pinned engine release accepts, read from its wheel's source without importing it.

A committed list (CI has 45 minutes, the vLLM wheel is 336 MB): `scripts/engine-flags.py` reads a
pinned wheel's argument definitions with `ast` into `flags/<engine>-<version>.json` (flags, sha256s).
Tests check every flag an adapter emits against it (re-extracting where the wheel is cached in
$LANEBENCH_CACHE/wheels); `lanebench plan` names lane flags the release does not define.

Where the names live:
- SGLang 0.5.23: fields `name: A[T, "help" | Arg(cli_name=, aliases=, no_cli=)]` of the classes in
  `sglang/srt/arg_groups/fields/*.py` (`--name-with-dashes`), plus `parser.add_argument("--...")` in
  `sglang/srt/server_args.py` (older releases declare every flag that way).
- vLLM 0.33.0: `add_argument("--...")` in `vllm/engine/arg_utils.py` and
  `vllm/entrypoints/common/cli_args.py`, plus the frontend argument classes' fields there (`host` ->
  `--host`); older releases kept those in `vllm/entrypoints/openai/cli_args.py`.

Boolean flags' inverses are flags the release accepts too (`plan` must not refuse them):
- argparse's `BooleanOptionalAction` adds `--no-<flag>`; SGLang declares it as
  `Arg(action=argparse.BooleanOptionalAction)` (other bools are `store_true`: `arg_groups/arg_utils.py`).
- vLLM's `EnableDisableAction` (`vllm/utils/argparse_utils.py`): `--x` also takes `--no-x`, and
  `--enable-y` takes `--disable-y` (and the reverse). A flag is boolean when its config field is typed
  `bool` (not `bool | str | None`; `_compute_kwargs` in `vllm/engine/arg_utils.py`), read through
  `get_kwargs(CacheConfig)` and `vllm/config/*.py`'s annotations (the real parser needs torch and
  CUDA). The 0.33.0 list matches the issue's count (50 `--enable-`/`--disable-` inverses).
- vLLM JSON arguments also take dotted keys (`--speculative-config.method eagle3`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import zipfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tasks.hosts.files import file_sha256
from tasks.inventory.paths import CACHE

FLAGS_DIR = Path(__file__).resolve().parent / "flags"
WHEEL_CACHE = CACHE / "wheels"  # under LANEBENCH_CACHE when set, like the builds and quantized models

# Source files (inside the wheel) that declare launch flags, per engine; patterns are regexes.
SOURCES = {
    "sglang": [r"sglang/srt/server_args\.py", r"sglang/srt/arg_groups/fields/[a-z_]+\.py"],
    "vllm": [r"vllm/engine/arg_utils\.py", r"vllm/entrypoints/common/cli_args\.py",
             r"vllm/entrypoints/openai/cli_args\.py", r"vllm/config/[a-z_]+\.py"],
}
_BOOL_ACTIONS = {"BooleanOptionalAction", "EnableDisableAction"}
_INVERSE_PREFIXES = {"--enable-": "--disable-", "--disable-": "--enable-"}
_FIELD_CLASSES = {"vllm": {"BaseFrontendArgs", "FrontendArgs"}}  # vLLM: only these classes' fields are flags


class ReleaseFlags(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: str
    version: str
    wheel: str
    wheel_sha256: str
    sources: dict[str, str]  # path inside the wheel -> sha256 of that file
    flags: list[str]


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _names(node: ast.AST | None) -> set[str]:
    """Every bare and dotted name in an expression (`argparse.BooleanOptionalAction` -> both parts)."""
    out: set[str] = set()
    for n in ast.walk(node) if node is not None else []:
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):  # a quoted annotation
            out.update(re.findall(r"\w+", n.value))
    return out


def negations(flag: str, engine: str) -> list[str]:
    """What a boolean flag's action adds: `--no-x` (argparse), and vLLM's `--enable-`/`--disable-` inverse."""
    out = ["--no-" + flag[2:]]
    if engine == "vllm":
        out += [inverse + flag.removeprefix(prefix) for prefix, inverse in _INVERSE_PREFIXES.items()
                if flag.startswith(prefix)]
    return out


def _sglang_field_flags(node: ast.AnnAssign) -> list[str]:
    """`name: A[T, "help"]` -> --name; `A[T, Arg(...)]` -> cli_name or --name, plus aliases
    (and `--no-` forms with `action=argparse.BooleanOptionalAction`)."""
    ann = node.annotation
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A"
            and isinstance(node.target, ast.Name) and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) >= 2):
        return []
    meta = ann.slice.elts[1]
    name = "--" + node.target.id.replace("_", "-")
    if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
        return [name]
    if not (isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg"):
        return []
    no_cli = _keyword(meta, "no_cli")
    if isinstance(no_cli, ast.Constant) and no_cli.value is True:
        return []
    cli = _keyword(meta, "cli_name")
    flags = [cli.value if isinstance(cli, ast.Constant) and isinstance(cli.value, str) else name]
    aliases = _keyword(meta, "aliases")
    if isinstance(aliases, ast.List):
        flags += [e.value for e in aliases.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if _names(_keyword(meta, "action")) & _BOOL_ACTIONS:
        flags += [n for f in flags if f.startswith("--") for n in negations(f, "sglang")]
    return flags


def _is_bool(annotation: ast.expr) -> bool:
    """vLLM `_compute_kwargs`: a field typed with bool is a BooleanOptionalAction, except
    `bool | str | None` (an optional-valued flag) and a config dataclass."""
    names = _names(annotation) - {"Optional", "Union", "None", "Annotated", "Field"}
    if "bool" not in names:
        return False
    return not (names <= {"bool", "str"} and "str" in names) and not any(n.endswith("Config") for n in names)


def _class_fields(trees: list[ast.Module]) -> dict[str, dict[str, ast.expr]]:
    """class name -> {field: annotation}, bases' fields included (dataclass `fields(cls)`)."""
    own: dict[str, tuple[list[str], dict[str, ast.expr]]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                fields = {i.target.id: i.annotation for i in node.body
                          if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
                own[node.name] = ([b.id for b in node.bases if isinstance(b, ast.Name)], fields)

    def merged(name: str, seen: frozenset[str] = frozenset()) -> dict[str, ast.expr]:
        if name not in own or name in seen:
            return {}
        bases, fields = own[name]
        out: dict[str, ast.expr] = {}
        for base in bases:
            out.update(merged(base, seen | {name}))
        return {**out, **fields}

    return {name: merged(name) for name in own}


def _kwargs_field(call: ast.Call) -> tuple[str, str] | None:
    """`add_argument(..., **NAME["field"])` or `**{**NAME["field"], ...}` -> (NAME, field)."""
    return next(((n.value.id, n.slice.value) for kw in call.keywords if kw.arg is None for n in ast.walk(kw.value)
                 if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and isinstance(n.slice, ast.Constant)
                 and isinstance(n.slice.value, str)), None)


def flags_in_source(engine: str, path: str, text: str,
                    classes: dict[str, dict[str, ast.expr]] | None = None) -> set[str]:
    """Every flag one source file defines, each boolean one with its inverses. `classes`: vLLM's
    config dataclasses' fields (default: this file's), which decide which flags are boolean."""
    tree = ast.parse(text)
    classes = classes if classes is not None else _class_fields([tree])
    configs = {node.targets[0].id: node.value.args[0].id for node in ast.walk(tree)  # vLLM's NAME = get_kwargs(Cls)
               if engine == "vllm" and isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
               and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
               and _names(node.value.func) & {"get_kwargs"} and node.value.args and isinstance(node.value.args[0], ast.Name)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("-")]
            boolean = bool(_names(_keyword(node, "action")) & _BOOL_ACTIONS)
            if (ref := _kwargs_field(node)) is not None and ref[0] in configs:
                annotation = classes.get(configs[ref[0]], {}).get(ref[1])
                boolean = boolean or (annotation is not None and _is_bool(annotation))
            found.update(flags)
            if boolean:
                found.update(n for f in flags if f.startswith("--") for n in negations(f, engine))
        elif engine == "vllm" and isinstance(node, ast.ClassDef) and node.name in _FIELD_CLASSES["vllm"]:
            for name, annotation in classes.get(node.name, {}).items():
                if not name.startswith("_"):
                    flag = "--" + name.replace("_", "-")
                    found.update([flag, *(negations(flag, "vllm") if _is_bool(annotation) else [])])
        elif engine == "sglang" and "/arg_groups/fields/" in path and isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign):
                    found.update(_sglang_field_flags(item))
    return {f for f in found if f.startswith("--")}


def extract(engine: str, wheel: Path) -> ReleaseFlags:
    """Read a wheel's flag definitions (zip + ast; nothing of the engine is imported)."""
    m = re.match(rf"{engine}-([^-]+)-", wheel.name)
    if m is None:
        raise ValueError(f"{wheel.name} is not a {engine} wheel")
    with zipfile.ZipFile(wheel) as z:
        data = {name: z.read(name) for name in sorted(z.namelist()) if any(re.fullmatch(p, name) for p in SOURCES[engine])}
    if not data:
        raise ValueError(f"{wheel.name} holds none of {SOURCES[engine]}")
    texts = {name: d.decode() for name, d in data.items()}
    classes = _class_fields([ast.parse(t) for t in texts.values()]) if engine == "vllm" else None
    flags = set().union(*(flags_in_source(engine, name, text, classes) for name, text in texts.items()))
    return ReleaseFlags(engine=engine, version=m[1], wheel=wheel.name, wheel_sha256=file_sha256(wheel),
                        sources={name: hashlib.sha256(d).hexdigest() for name, d in data.items()}, flags=sorted(flags))


def path_for(engine: str, version: str) -> Path:
    return FLAGS_DIR / f"{engine}-{version}.json"


def load(engine: str, version: str) -> ReleaseFlags | None:
    """The committed flag list of a release (None when no list was extracted for it)."""
    path = path_for(engine, version)
    return ReleaseFlags.model_validate(json.loads(path.read_text())) if path.is_file() else None


def cached_wheel(engine: str, version: str) -> Path | None:
    found = sorted(WHEEL_CACHE.glob(f"{engine}-{version}-*.whl")) if WHEEL_CACHE.is_dir() else []
    return found[0] if found else None


def unknown_flags(argv: list[str], known: ReleaseFlags) -> list[str]:
    """Flags in an argv (`--name` or `--name=value`) the release does not define. The list holds
    every inverse (`--no-x`, vLLM's `--disable-x`); vLLM also reads `_` as `-` and a JSON
    argument's dotted keys (`--speculative-config.method`)."""
    defined = set(known.flags)
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name = token.split("=", 1)[0]
            if known.engine == "vllm":
                name = name.replace("_", "-")
                if "." in name and name.split(".", 1)[0] in defined:
                    continue
            if name not in defined:
                out.append(name)
    return out
