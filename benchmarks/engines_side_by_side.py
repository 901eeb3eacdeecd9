"""vLLM against llama.cpp on the same weights and the same machine, in one sitting.

`lanebench nightly` on the llama.cpp rehearsal lane (hosts.yaml), then on the three vLLM lanes
(hosts.vllm.yaml), each once the 1-minute load is under --quiet; prints markdown tables of boot,
decode curve and acceptance per class. A run that started busy is marked so and is no result.

    uv run python benchmarks/engines_side_by_side.py [--quiet 0.5] [--settle-s 600]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from _common import REPO, run_folder, settle

from tasks.record.manifest import read_manifest
from tasks.record.markdown import table

RUNS = [("llama.cpp", "hosts.yaml"), ("vLLM", "hosts.vllm.yaml")]


def nightly(hosts: str, artifacts: Path) -> tuple[Path, float]:
    """One nightly into a fresh artifacts folder: no earlier night's baseline judges it."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flows.cli", "nightly", "--hosts", hosts, "--artifacts", str(artifacts)],
                       cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"lanebench nightly --hosts {hosts} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return run_folder(r, f"lanebench nightly --hosts {hosts}"), time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", type=float, default=0.5, help="1-minute load under which a run may start")
    ap.add_argument("--settle-s", type=float, default=600)
    args = ap.parse_args()
    cores = os.cpu_count()
    print(f"machine: {platform.node()}, {cores} cores, {platform.platform()}; started {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    boots, curves, accs = [], [], []
    for engine, hosts in RUNS:
        load = settle(args.quiet, args.settle_s, 10)
        folder, wall = nightly(hosts, Path(tempfile.mkdtemp(prefix="lanebench-side-by-side-")))
        manifest = read_manifest(folder)
        busy = " (busy: not a result)" if load >= args.quiet else ""
        for lane, rec in manifest.lanes.items():
            extra = rec.boot_facts.get("extra")
            extra = extra if isinstance(extra, dict) else {}
            boots.append([engine, lane, rec.status, f"{rec.boot_seconds or 0:.1f}",
                          f"{extra['init_engine_s']:.1f}" if "init_engine_s" in extra else "",
                          f"{load:.2f}{busy}", f"{wall:.0f}"])
            if (folder / lane / "decode.parquet").exists():
                d = pd.read_parquet(folder / lane / "decode.parquet")
                for row in d.itertuples():
                    curves.append([engine, lane, int(row.concurrency), f"{row.aggregate_tok_s:.1f}",
                                   f"{row.aggregate_spread_pct:.0f}", f"{row.per_user_tok_s:.1f}", f"{1000 * row.ttft_p50_s:.1f}"])
            if (folder / lane / "acceptance.parquet").exists():
                a = pd.read_parquet(folder / lane / "acceptance.parquet")
                for row in a.itertuples():
                    logged = getattr(row, "engine_logged_acceptance_length", None)
                    accs.append([engine, lane, row.prompt_class, int(row.k), f"{row.acceptance_length:.2f}",
                                 " · ".join(f"{p:.2f}" for p in row.per_position),
                                 "" if logged is None or pd.isna(logged) else f"{logged:.2f}"])
    tables: list[tuple[str, list[str], list]]
    tables = [("boot", ["engine", "lane", "status", "boot s", "engine init s", "load at start", "nightly wall s"], boots),
             ("decode curve", ["engine", "lane", "C", "agg tok/s", "spread %", "per-user tok/s", "TTFT p50 ms"], curves),
             ("acceptance", ["engine", "lane", "class", "K", "acceptance length", "per position", "engine's own log"], accs)]
    for title, head, rows in tables:
        print(f"\n#### {title}\n")
        print("\n".join(table(head, rows)))


if __name__ == "__main__":
    main()
