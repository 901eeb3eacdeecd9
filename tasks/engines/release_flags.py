"""The launch flags a pinned engine release accepts, read from its wheel's source without importing it.

Why a committed list: CI has package-registry network and 45 minutes; the vLLM wheel is
336 MB. `scripts/engine-flags.py` downloads a pinned wheel once (`pip download --no-deps`),
reads the argument definitions with `ast` and writes `flags/<engine>-<version>.json` here:
every flag name, plus the sha256 of the wheel and of each source file the names came from.
Tests check every flag an adapter emits against that list, and re-extract from the wheel when
one is cached in ~/.cache/lanebench/wheels (so a stale list is caught wherever the wheel is at
hand); `lanebench plan` names lane flags the release does not define.

Where the names live:
- SGLang (0.5.23): fields `name: A[T, "help" | Arg(cli_name=, aliases=, no_cli=)]` of the
  namespace classes in `sglang/srt/arg_groups/fields/*.py` (registered by
  `add_cli_args_from_dataclass` as `--name-with-dashes`), plus explicit
  `parser.add_argument("--...")` calls in `sglang/srt/server_args.py` (older releases declare
  every flag that way).
- vLLM (0.33.0): `add_argument("--...")` in `vllm/engine/arg_utils.py` and
  `vllm/entrypoints/common/cli_args.py` (`--headless`, ...), plus the fields of the frontend
  argument classes there (`FrontendArgs.add_cli_args` turns `host` into `--host`); older
  releases kept those in `vllm/entrypoints/openai/cli_args.py`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import zipfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

FLAGS_DIR = Path(__file__).resolve().parent / "flags"
WHEEL_CACHE = Path.home() / ".cache" / "lanebench" / "wheels"

# Source files (inside the wheel) that declare launch flags, per engine; patterns are regexes.
SOURCES = {
    "sglang": [r"sglang/srt/server_args\.py", r"sglang/srt/arg_groups/fields/[a-z_]+\.py"],
    "vllm": [r"vllm/engine/arg_utils\.py", r"vllm/entrypoints/common/cli_args\.py",
             r"vllm/entrypoints/openai/cli_args\.py"],
}
_FIELD_CLASSES = {"vllm": {"BaseFrontendArgs", "FrontendArgs"}}  # vLLM: only these classes' fields are flags


class ReleaseFlags(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: str
    version: str
    wheel: str
    wheel_sha256: str
    sources: dict[str, str]  # path inside the wheel -> sha256 of that file
    flags: list[str]


def _constant_flags(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            and a.value.startswith("-")]


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _sglang_field_flags(node: ast.AnnAssign) -> list[str]:
    """`name: A[T, "help"]` -> --name; `A[T, Arg(...)]` -> cli_name or --name, plus aliases."""
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
    return flags


def flags_in_source(engine: str, path: str, text: str) -> set[str]:
    """Every flag one source file defines (engine decides which declaration shapes count)."""
    tree = ast.parse(text)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            found.update(_constant_flags(node))
        if engine == "sglang" and "/arg_groups/fields/" in path and isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign):
                    found.update(_sglang_field_flags(item))
        if engine == "vllm" and isinstance(node, ast.ClassDef) and node.name in _FIELD_CLASSES["vllm"]:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                        and not item.target.id.startswith("_"):
                    found.add("--" + item.target.id.replace("_", "-"))
    return {f for f in found if f.startswith("--")}


def extract(engine: str, wheel: Path) -> ReleaseFlags:
    """Read a wheel's flag definitions (zip + ast; nothing of the engine is imported)."""
    m = re.match(rf"{engine}-([^-]+)-", wheel.name)
    if m is None:
        raise ValueError(f"{wheel.name} is not a {engine} wheel")
    flags: set[str] = set()
    sources: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if any(re.fullmatch(p, name) for p in SOURCES[engine]):
                data = z.read(name)
                sources[name] = hashlib.sha256(data).hexdigest()
                flags |= flags_in_source(engine, name, data.decode())
    if not sources:
        raise ValueError(f"{wheel.name} holds none of {SOURCES[engine]}")
    return ReleaseFlags(engine=engine, version=m[1], wheel=wheel.name,
                        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                        sources=sources, flags=sorted(flags))


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
    """Flags in an argv (`--name` or `--name=value`) the release does not define."""
    defined = set(known.flags)
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name = token.split("=", 1)[0]
            name = name.replace("_", "-")
            # argparse's BooleanOptionalAction adds --no-<flag> (vLLM's boolean engine args).
            if name not in defined and not (name.startswith("--no-") and "--" + name[5:] in defined):
                out.append(name)
    return out
