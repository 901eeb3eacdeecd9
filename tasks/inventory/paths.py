"""Where lanebench's own files are: the checkout and the cache outside it (at the bottom of the layers,
so a shipped file is found without importing an engine's build module)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]



# Builds, quantized models, wheels, sha256s; LANEBENCH_CACHE moves it (tests, a bigger disk). Not the store
# mirrors (LANEBENCH_STORE_MIRRORS) nor a host's pidfiles (~/.cache/lanebench/run on that host).
CACHE = Path(os.environ.get("LANEBENCH_CACHE", Path.home() / ".cache" / "lanebench"))


def resolve(base_dir: Path, p: str) -> Path:
    """A path a config file states, relative to that file's folder (`~` expanded): the one rule for
    every path an input file names, checked or used."""
    q = Path(p).expanduser()
    return q if q.is_absolute() else (base_dir / q).resolve()
