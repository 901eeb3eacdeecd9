"""Where lanebench's own files are: the checkout and the cache outside it (at the bottom of the layers,
so a shipped file is found without importing an engine's build module)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Builds, quantized models, wheels, sha256s; LANEBENCH_CACHE moves it (tests, a bigger disk). Not the store
# mirrors (LANEBENCH_STORE_MIRRORS) nor a host's pidfiles (~/.cache/lanebench/run on that host).
CACHE = Path(os.environ.get("LANEBENCH_CACHE", Path.home() / ".cache" / "lanebench"))
