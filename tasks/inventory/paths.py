"""Where lanebench's own files are: the repository checkout and the cache outside it.

One module at the bottom of the layers, so that a stage, a flow or a report that needs a shipped
file (scripts/, testbed/, toolsuites/, expectations/) does not import an engine's build module
to learn where the repository is.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Builds, quantized models and mirrors; LANEBENCH_CACHE moves it (tests, a bigger disk).
CACHE = Path(os.environ.get("LANEBENCH_CACHE", Path.home() / ".cache" / "lanebench"))
