"""File facts for the manifest: bytes and sha256, with the hash cached by size and mtime.

`file_sha256` is the one way lanebench hashes a file's bytes; `Sha256Cache` the one cache of
digests, for files here and on the hosts (tasks/hosts/checks.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

from tasks.inventory.paths import CACHE

_CACHE = CACHE / "sha256.json"


def file_sha256(source: str | Path | BinaryIO) -> str:
    """sha256 (hex) of a file's bytes: a path, or a binary file object (an fsspec store's) read from where it stands."""
    if not isinstance(source, (str, Path)):
        digest = hashlib.sha256()
        while chunk := source.read(1 << 20):
            digest.update(chunk)
        return digest.hexdigest()
    with Path(source).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Sha256Cache:
    """sha256 by key (a local path, or `host|address|path`), valid while size and mtime are unchanged; one JSON file."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path or _CACHE)
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            entries = {}
        self.entries: dict[str, dict] = entries if isinstance(entries, dict) else {}

    def get(self, key: str, size: int, mtime: int) -> str | None:
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("bytes") == size and entry.get("mtime") == mtime:
            return entry.get("sha256")
        return None

    def put(self, key: str, size: int, mtime: int, digest: str) -> None:
        self.entries[key] = {"bytes": size, "mtime": mtime, "sha256": digest}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".sha256.")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)  # concurrent lanes: last writer wins, a reader never sees half a file
        except OSError:
            pass  # a cache that cannot be written costs a hash next time, nothing else


def sha256_of(path: str | Path) -> str:
    """sha256 of a file; large model files are hashed once per (size, mtime)."""
    path = Path(path).resolve()
    st, cache = path.stat(), Sha256Cache()
    if (digest := cache.get(str(path), st.st_size, st.st_mtime_ns)) is None:
        digest = file_sha256(path)
        cache.put(str(path), st.st_size, st.st_mtime_ns, digest)
    return digest


def folder_sha256(path: str | Path) -> tuple[int, str]:
    """Bytes and sha256 of a model folder (a Hugging Face checkpoint): the sha256 of its sorted
    `sha256sum`-style listing of the files, hidden ones left out, so `sha256sum` reproduces it."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(root).parts))
    listing = "".join(f"{sha256_of(f)}  {f.relative_to(root).as_posix()}\n" for f in files)
    return sum(f.stat().st_size for f in files), hashlib.sha256(listing.encode()).hexdigest()


def model_sha256(path: str | Path) -> str:
    """sha256 of a model as preflight records it: a GGUF file's, or a model folder's listing digest."""
    return folder_sha256(path)[1] if Path(path).is_dir() else sha256_of(path)

