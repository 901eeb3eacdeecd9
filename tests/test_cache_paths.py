"""LANEBENCH_CACHE moves every cache lanebench keeps on this machine (tests and a bigger disk rely on
it); the wheel cache once stayed under ~/.cache/lanebench whatever the variable said."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_local_cache_lies_under_lanebench_cache(tmp_path):
    probe = ("import tasks.engines.release_flags as r, tasks.hosts.files as f, tasks.kl.stages as k\n"
             "print(r.WHEEL_CACHE, f._CACHE, k.CACHE / 'quant', sep='\\n')")
    env = {**os.environ, "LANEBENCH_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 3 and all(Path(p).is_relative_to(tmp_path / "cache") for p in out), out
