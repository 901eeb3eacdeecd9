"""Wall time of a first nightly on a fresh machine: the cold llama.cpp build, then the run.

Target (issue 2): under 10 minutes on 2 cores, build included. Uses a throwaway cache
folder so the build is really cold, and prints one markdown row for docs/benchmarks.md.

    uv run python benchmarks/rehearsal_wall_time.py [--warm]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, cpu


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", action="store_true", help="reuse ~/.cache/lanebench (time the run alone)")
    args = ap.parse_args()
    env = dict(os.environ)
    load = os.getloadavg()[0]  # tok/s is only worth quoting from an idle machine
    with tempfile.TemporaryDirectory() as tmp:
        if not args.warm:
            env["LANEBENCH_CACHE"] = str(Path(tmp) / "cache")
        t0 = time.monotonic()
        subprocess.run(["bash", str(REPO / "scripts/build-llama-cpp.sh")], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        build = time.monotonic() - t0
        t1 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "flows.cli", "nightly", "--artifacts", str(Path(tmp) / "a")],
                           env=env, cwd=REPO, capture_output=True, text=True)
        run = time.monotonic() - t1
    total = build + run
    print(f"| {time.strftime('%Y-%m-%d')} | {cpu()}, {os.cpu_count()} cores | {'warm' if args.warm else 'cold'} | load {load:.2f} | "
          f"{build:.0f} s | {run:.0f} s | {total:.0f} s | {'yes' if total < 600 else 'NO'} | exit {r.returncode} |")
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
