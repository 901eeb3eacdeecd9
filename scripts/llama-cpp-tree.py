#!/usr/bin/env python3
"""The pinned llama.cpp source tree: the files the server, quantize, perplexity and rpc-server
builds need (CPU and CUDA backends), cut out of the pinned sdist, each pinned by sha256.

Why: a GPU machine with no network gets the source as a copy (the whole sdist is ~77 MB, this
tree ~8 MB), and a copy is only trusted when every file matches the manifest
(`scripts/llama-cpp-tree.sha256`, one "sha256  path" line per file, sha256sum's format), not
only when a download's archive hash did. Standard library only: it runs before any venv exists.

  llama-cpp-tree.py extract SDIST DEST     the pinned files of the sdist into DEST, checked
  llama-cpp-tree.py check TREE             exit 1 naming the first file missing, extra or changed
  llama-cpp-tree.py manifest SDIST         print a manifest for a new pin (review it, commit it)
  llama-cpp-tree.py hash                   the source hash: sha256 of the manifest (the cache key)
"""

from __future__ import annotations

import hashlib
import sys
import tarfile
from pathlib import Path

MANIFEST = Path(__file__).with_name("llama-cpp-tree.sha256")
# What the build reads, relative to the sdist's vendor/llama.cpp. Other ggml backends, docs,
# models, tests, examples and the web UI's sources are left out (the UI is not built:
# -DLLAMA_USE_PREBUILT_UI=OFF and no npm).
KEEP_DIRS = (
    "cmake/", "common/", "include/", "src/", "vendor/", "licenses/", "ggml/cmake/", "ggml/include/",
    "ggml/src/ggml-cpu/", "ggml/src/ggml-cuda/", "ggml/src/ggml-rpc/", "ggml/src/ggml-blas/",
    "tools/batched-bench/", "tools/gguf-split/", "tools/imatrix/", "tools/llama-bench/",
    "tools/completion/", "tools/perplexity/", "tools/quantize/", "tools/cli/", "tools/server/",
    "tools/tokenize/", "tools/tts/", "tools/mtmd/", "tools/rpc/", "tools/cvector-generator/",
    "tools/export-lora/", "tools/fit-params/", "tools/results/",
)
KEEP_FILES = (
    "CMakeLists.txt", "LICENSE", "ggml/CMakeLists.txt", "tools/CMakeLists.txt",
    "scripts/ui-assets.cmake", "tools/ui/CMakeLists.txt", "tools/ui/sources.cmake",
    "tools/ui/ui.cpp.in", "tools/ui/ui.h.in",
)
DROP_DIRS = ("tools/server/tests/", "tools/server/public", "tools/mtmd/tests/")


def kept(rel: str) -> bool:
    """A pinned file, or ggml/src's own (not its backend folders')."""
    return not rel.startswith(DROP_DIRS) and (rel in KEEP_FILES or rel.startswith(KEEP_DIRS) or (
        rel.startswith("ggml/src/") and "/" not in rel.removeprefix("ggml/src/")))


def _members(sdist: Path):
    with tarfile.open(sdist) as tar:
        for m in tar:
            parts = m.name.split("/", 3)
            if not m.isfile() or len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"]:
                continue
            if kept(parts[3]):
                yield parts[3], m, tar.extractfile(m).read()


def read_manifest(path: Path = MANIFEST) -> dict[str, str]:
    return {rel: digest for digest, rel in (line.split("  ", 1) for line in path.read_text().splitlines())}


def check(tree: Path, pins: dict[str, str]) -> str | None:
    """The first problem with TREE against the pins, or None when it is exactly the pinned tree."""
    have = {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}
    for rel in sorted(pins):
        if rel not in have:
            return f"{rel} is missing"
        if hashlib.sha256((tree / rel).read_bytes()).hexdigest() != pins[rel]:
            return f"{rel} does not match its pinned sha256"
    extra = sorted(have - set(pins))
    return f"{extra[0]} is not in the pinned tree ({len(extra)} extra files)" if extra else None


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else ""
    if cmd == "hash" and len(argv) == 1:
        print(hashlib.sha256(MANIFEST.read_bytes()).hexdigest())
    elif cmd == "manifest" and len(argv) == 2:
        for rel, _, data in sorted(_members(Path(argv[1])), key=lambda t: t[0]):
            print(f"{hashlib.sha256(data).hexdigest()}  {rel}")
    elif cmd == "extract" and len(argv) == 3:
        pins, dest = read_manifest(), Path(argv[2])
        for rel, member, data in _members(Path(argv[1])):
            if rel in pins:
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
                out.chmod(0o755 if member.mode & 0o111 else 0o644)
        if problem := check(dest, pins):
            print(f"llama-cpp-tree: {argv[1]}: {problem}", file=sys.stderr)
            return 1
    elif cmd == "check" and len(argv) == 2:
        if problem := check(Path(argv[1]), read_manifest()):
            print(f"llama-cpp-tree: {argv[1]}: {problem} (pinned in {MANIFEST.name})", file=sys.stderr)
            return 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
