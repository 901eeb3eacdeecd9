"""File facts for the manifest: bytes and sha256, with the hash cached by size and mtime."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_CACHE = Path(os.environ.get("LANEBENCH_CACHE", Path.home() / ".cache" / "lanebench")) / "sha256.json"


def file_sha256(path: str | Path) -> str:
    """sha256 of a file as it is now (artifacts, which change while a run writes them)."""
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_of(path: str | Path) -> str:
    """sha256 of a file; large model files are hashed once per (size, mtime)."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    try:
        cache = json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    cache[key] = file_sha256(path)
    try:
        _CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _CACHE.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(_CACHE)
    except OSError:
        pass
    return cache[key]
