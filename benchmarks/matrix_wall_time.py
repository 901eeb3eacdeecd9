"""Wall time of the rehearsal drafter matrix (`lanebench matrix matrix/rehearsal.yaml`).

Target (issue 5): under 15 minutes on 2 cores, with the llama.cpp build already cached. Prints
one markdown row for docs/benchmarks.md, with the 1-minute load average before the run (speed
rows are only worth quoting from an idle machine; acceptance does not depend on load).

    uv run python benchmarks/matrix_wall_time.py [--keep DIR]   # --keep: leave the run folder in DIR
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from _common import REPO, cpu, run_folder

from tasks.record.manifest import MatrixVerdict, read_manifest


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="artifacts folder to keep the run in (default: a temporary one)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "flows.cli", "matrix", "matrix/rehearsal.yaml", "--artifacts", tmp],
                           cwd=REPO, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        matrix = read_manifest(run_folder(r, "lanebench matrix")).flow.matrix
        verdict = matrix.verdict if matrix and matrix.verdict else MatrixVerdict(complete=False)
    print(f"| {time.strftime('%Y-%m-%d')} | {cpu()}, {os.cpu_count()} cores | load {load:.2f} | "
          f"{seconds:.0f} s | {'yes' if seconds < 900 else 'NO'} | "
          f"{verdict.bars_passed} passed, {verdict.bars_failed} failed | exit {r.returncode} |")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
