"""Where a rehearsal nightly's wall time goes: measuring, or lanebench's own overhead.

Target (issue 11): at least 80% of `lanebench nightly`'s wall time is spent booting the server
or with requests in flight. Measured from outside, for any checkout: wall (launch to exit);
measuring = boot plus the union of every request's in-flight span, from every raw record and
gate verdict that has one (docs/benchmarks.md: what was counted when). Boot plus in flight
above the lanes' own span is a counting error, refused. The share of the flow's own span
beside the share of wall shows what the command pays around the flow; the manifest's timeline
gives a stage-by-stage breakdown.

`--server running` runs every nightly against one Prefect server started before them (a deployed
nightly's case); `ephemeral` starts one per command. `--baseline REF` alternates with a git
worktree of REF. Each row records the 1-minute load and CPU steal; a busy start is marked busy.

    uv run python benchmarks/nightly_overhead.py [--runs 2] [--baseline 7bee0d8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import REPO, cpu, run_folder, settle, steal

from tasks.record.manifest import read_manifest
from tasks.record.markdown import table

MEASURING = {"boot", "boot gates", "warmup", "decode curve", "acceptance probe", "tool gate", "needle ladder",
             "prefill ladder", "accuracy eval"}
BUSY_LOAD = 0.5  # 1-minute load above which a row is marked busy (2 cores, nothing else should run)


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def gate_requests(node: object) -> list[tuple[float, float]]:
    """The in-flight spans the manifest's gate verdicts carry (boot gates, agentic smoke,
    thinking switch; `requests` on every gate dict, wherever the manifest keeps it)."""
    if isinstance(node, list):
        return [span for item in node for span in gate_requests(item)]
    if not isinstance(node, dict):
        return []
    if "gate" in node and isinstance(node.get("requests"), list):
        return [(r["started_at"], r["started_at"] + r["seconds"]) for r in node["requests"]]
    return [span for value in node.values() for span in gate_requests(value)]


def measured(folder: Path) -> dict:
    """Measuring seconds of a run folder, and its stage breakdown where the timeline exists."""
    m = read_manifest(folder).model_dump(mode="json")  # walked as JSON: gate requests wherever they sit
    out: dict[str, Any] = {"boot_s": 0.0, "in_flight_s": 0.0, "lane_s": 0.0, "stages": {}, "gx_s": 0.0}
    for lane, record in m["lanes"].items():
        out["boot_s"] += record.get("boot_seconds") or 0.0
        # the boot gates' own requests (lanes.<lane>.gates), the agentic ones' (flow.correctness)
        spans = gate_requests(record) + gate_requests((m["flow"].get("correctness") or {}).get(lane))
        # Timed records run from started_at for their end-to-end latency; the tool gate's and the
        # accuracy eval's requests (sent concurrently) for their seconds: their spans, never a sum.
        for name, took in (("requests.jsonl", "e2el_s"), ("prefill.jsonl", "e2el_s"),
                           ("tool_cases.jsonl", "seconds"), ("accuracy.jsonl", "seconds")):
            raw = folder / lane / name
            if raw.is_file():
                for line in raw.read_text().splitlines():
                    r = json.loads(line)
                    if r.get("started_at") and r.get(took):
                        spans.append((r["started_at"], r["started_at"] + r[took]))
        needles = folder / lane / "needles.parquet"  # the needle ladder's rungs (sent two at a time)
        if needles.is_file():
            import pandas as pd

            df = pd.read_parquet(needles)
            if "started_at" in df:
                spans += [(a, a + s) for a, s in zip(df.started_at, df.seconds) if a == a and a and s]
        out["in_flight_s"] += union(spans)
        marks = record.get("timeline") or []
        out["lane_s"] += marks[-1]["at"] - marks[0]["at"] if marks else 0.0
        for a, b in zip(marks, marks[1:]):
            out["stages"][a["stage"]] = out["stages"].get(a["stage"], 0.0) + b["at"] - a["at"]
    out["gx_s"] = sum(a.get("validation_seconds") or 0.0 for a in m["artifacts"])
    out["flow_started_at"] = m["flow"]["started_at"]
    out["flow_s"] = (datetime.fromisoformat(m["flow"]["finished_at"]) - datetime.fromisoformat(m["flow"]["started_at"])
                     ).total_seconds()
    out["status"] = {n: r["status"] for n, r in m["lanes"].items()}
    return out


def one_run(checkout: Path, artifacts: Path, api_url: str | None = None) -> dict:
    load = settle(BUSY_LOAD, 300, 5)  # a nightly leaves the load near 1.4 on 2 cores: the next must not start on that
    s0, t0 = steal()
    env = {**os.environ, "DO_NOT_TRACK": "1"} | ({"PREFECT_API_URL": api_url} if api_url else {})
    start = time.time()
    r = subprocess.run(["uv", "run", "--frozen", "--project", str(checkout), "lanebench", "nightly", "--artifacts",
                        str(artifacts)], cwd=checkout, capture_output=True, text=True, env=env)
    wall = time.time() - start
    s1, t1 = steal()
    folder = run_folder(r, f"lanebench nightly in {checkout}")
    if not (folder / "manifest.json").is_file():
        raise SystemExit(f"no run folder from {checkout}: {r.stdout[-1500:]}{r.stderr[-1500:]}")
    got = measured(folder)
    if set(got["status"].values()) != {"passed"}:
        raise SystemExit(f"{checkout}: the nightly did not pass ({got['status']}); no share to report:\n"
                         f"{r.stdout[-1500:]}{r.stderr[-2500:]}")
    counted = got["boot_s"] + got["in_flight_s"]
    if got["lane_s"] and counted > got["lane_s"] + 0.5:
        raise SystemExit(f"counting error: {counted:.1f} s measuring inside lanes that lasted {got['lane_s']:.1f} s")
    share = counted / wall
    return {"wall_s": wall, "share": share, "flow_share": counted / got["flow_s"], "exit": r.returncode, "load": load,
            "steal_pct": 100.0 * (s1 - s0) / max(1, t1 - t0), **got}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2, help="runs per checkout (alternating)")
    ap.add_argument("--baseline", help="git ref to compare against, run from a temporary worktree")
    ap.add_argument("--server", choices=["ephemeral", "running"], default="ephemeral",
                    help="ephemeral: each run starts its own API server; running: one started before the runs")
    args = ap.parse_args()
    subprocess.run(["bash", str(REPO / "scripts/build-llama-cpp.sh")], check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        api_url = None
        if args.server == "running":
            from flows.deployments import server  # the checkout is on sys.path (_common)

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            api_url = stack.enter_context(server("127.0.0.1", port, Path(tmp) / "prefect-home"))
        checkouts = {"this checkout": REPO}
        if args.baseline:
            wt = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(wt), args.baseline],
                           check=True, capture_output=True)
            subprocess.run(["uv", "sync", "--frozen", "--quiet"], cwd=wt, check=True)
            checkouts = {f"{args.baseline} (before)": wt, **checkouts}
        rows: list[tuple[str, dict[str, Any]]] = []
        try:
            for i in range(args.runs):
                for name, checkout in checkouts.items():
                    row = one_run(checkout, Path(tmp) / f"art-{i}-{len(rows)}", api_url)
                    rows.append((name, row))
                    print(f"{name}: wall {row['wall_s']:.1f} s, measuring {100 * row['share']:.0f}% of it "
                          f"({100 * row['flow_share']:.0f}% of the flow's {row['flow_s']:.1f} s), "
                          f"load {row['load']:.2f}", file=sys.stderr)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(tmp) / "baseline")],
                               capture_output=True)
    print(f"machine: {cpu()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"Prefect API server: {args.server}\n")
    print("| checkout | wall s | flow s | boot s | requests in flight s | share of wall | share of flow | GX s "
          "| load at start | steal % | exit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        busy = " (busy)" if r["load"] > BUSY_LOAD or r["steal_pct"] > 5 else ""
        print(f"| {name} | {r['wall_s']:.1f} | {r['flow_s']:.1f} | {r['boot_s']:.1f} | {r['in_flight_s']:.1f} "
              f"| {100 * r['share']:.0f}%{busy} | {100 * r['flow_share']:.0f}%{busy} | {r['gx_s']:.1f} | {r['load']:.2f} "
              f"| {r['steal_pct']:.1f} | {r['exit']} |")
    last = rows[-1][1]
    if last["stages"]:
        total = last["wall_s"]
        print("\nStage breakdown of the last run of this checkout (from the manifest's timeline):\n")
        outside = ("outside the lane (imports, Prefect server, flow set-up, baseline, report, exit)",
                   total - sum(last["stages"].values()))
        print("\n".join(table(["stage", "seconds", "share of wall", "counts as"], (
            [stage, f"{s:.1f}", f"{100 * s / total:.0f}%", "measuring" if stage in MEASURING else "overhead"]
            for stage, s in [*last["stages"].items(), outside]))))
    return 1 if any(r["exit"] for _, r in rows) else 0  # a failed nightly is no measurement


if __name__ == "__main__":
    sys.exit(main())
