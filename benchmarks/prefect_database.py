"""Prefect's server on PostgreSQL against SQLite, side by side in one run (issue 29).

Two `prefect server start` processes at once, one on SQLite, one on a PostgreSQL cluster of the
run's own (tests/pg_fixture.py); rounds alternate which goes first and give median
PostgreSQL/SQLite ratios of API latency (the calls a flow run makes, with no retry: a 503 is
counted, not hidden) and of per-flow-run overhead. docs/benchmarks.md says what each part sends.

    uv run python benchmarks/prefect_database.py [--rounds 3] [--clients 8] [--requests 40]
                                                 [--procs 4] [--flows 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
from _common import REPO, steal

sys.path.insert(0, str(REPO / "tests"))
from flows.deployments import server
from pg_fixture import Cluster  # the tests' real PostgreSQL, reused
from prefect_stack import free_port

FLOWS = """
import json, sys, time
from prefect import flow

@flow(name="empty", log_prints=False)
def empty() -> None:
    return None

empty()  # the process's first flow run pays for loading Prefect's run machinery: not counted
times = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    empty()
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _client(api: str, flow_id: str, n: int, at: str, lat: dict[str, list[float]], errors: Counter[str]) -> None:
    """`n` flow runs' worth of API calls; latency of the answered ones, errors counted by status."""
    async with httpx.AsyncClient(base_url=api, timeout=60) as c:
        async def timed(kind: str, method: str, path: str, body: dict) -> dict | None:
            errors[f"sent {at}"] += 1
            t = time.perf_counter()
            try:
                r = await c.request(method, path, json=body)
            except httpx.TransportError as e:  # the server dropped the connection: counted, not retried
                errors[f"{type(e).__name__} {at}"] += 1
                return None
            if r.status_code >= 400:  # no retry: SQLite's "database is locked" 503 shows here
                errors[f"{r.status_code} {at}"] += 1
                return None
            lat.setdefault(f"{kind} {at}", []).append(time.perf_counter() - t)
            return r.json()

        for _ in range(n):
            run = await timed("create flow run", "POST", "/flow_runs/", {"flow_id": flow_id, "state": {"type": "PENDING"}})
            if run is not None:
                for state in ("RUNNING", "COMPLETED"):
                    await timed("set state", "POST", f"/flow_runs/{run['id']}/set_state",
                                {"state": {"type": state}, "force": True})
            await timed("filter flow runs", "POST", "/flow_runs/filter", {"limit": 10, "sort": "EXPECTED_START_TIME_DESC"})


def api_latency(api: str, clients: int, requests: int) -> tuple[dict[str, list[float]], Counter[str]]:
    """One client alone (the request's own cost), then `clients` at once (writers contending)."""
    flow_id = httpx.post(f"{api}/flows/", json={"name": "latency-bench"}, timeout=60).json()["id"]
    lat: dict[str, list[float]] = {}
    errors: Counter[str] = Counter()
    for n in (1, clients):
        at = f"@{n} client{'s' if n > 1 else ''}"

        async def all_clients(n: int = n, at: str = at) -> None:
            await asyncio.gather(*(_client(api, flow_id, requests, at, lat, errors) for _ in range(n)))

        asyncio.run(all_clients())
    return lat, errors


def flow_overhead(api: str, home: Path, procs: int, flows: int) -> tuple[list[float], int, float]:
    """Per flow-run seconds over every process, failed processes, and the wall of all of them."""
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "DO_NOT_TRACK": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    t = time.perf_counter()
    ps = [subprocess.Popen([sys.executable, "-c", FLOWS, str(flows)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(procs)]
    times, failed = [], 0
    for p in ps:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            failed += 1
            print(f"flow process failed ({p.returncode}): {err.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        times += json.loads(out.strip().splitlines()[-1])
    return times, failed, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40, help="flow runs each API client creates (4 requests each)")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--flows", type=int, default=10, help="empty flows each process runs")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lanebench-dbbench-"))
    os.chmod(root, 0o755)
    cluster = Cluster(root / "pg")
    (root / "pg").mkdir()
    results: dict[str, dict[str, list]] = {b: {"lat": [], "run": [], "err": [], "failed": [], "rate": []}
                                           for b in ("sqlite", "postgresql")}
    loads: list[float] = []
    steal0 = steal()
    try:
        cluster.start()
        database = cluster.create_database("prefect_bench")
        with ExitStack() as stack:
            apis = {}
            for backend, url in (("sqlite", None), ("postgresql", database)):
                home = root / backend
                home.mkdir()
                apis[backend] = (stack.enter_context(server("127.0.0.1", free_port(), home, database=url, extra_env={
                    "PREFECT_UI_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING"})), home)
            for i in range(args.rounds):
                for backend in (("sqlite", "postgresql") if i % 2 == 0 else ("postgresql", "sqlite")):
                    api, home = apis[backend]
                    loads.append(os.getloadavg()[0])
                    lat, errors = api_latency(api, args.clients, args.requests)
                    times, failed, fwall = flow_overhead(api, home / "client", args.procs, args.flows)
                    loads.append(os.getloadavg()[0])
                    for key, value in (("lat", lat), ("err", errors), ("run", times), ("failed", failed),
                                       ("rate", len(times) / fwall if fwall else 0.0)):
                        results[backend][key].append(value)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    steal1 = steal()
    steal_pct = 100 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1])
    print(report(results, args, loads, steal_pct))
    failed = sum(sum(r["failed"]) for r in results.values())
    return 1 if failed else 0


def report(results: dict, args: argparse.Namespace, loads: list[float], steal_pct: float) -> str:
    kinds = sorted({k for r in results.values() for lat in r["lat"] for k in lat})
    lines = [f"## Prefect server: PostgreSQL vs SQLite ({args.rounds} rounds, alternating; 1, then {args.clients} API "
             f"clients x {args.requests} flow runs each (latency: answered calls only); "
             f"{args.procs} processes x {args.flows} empty flows)", "",
             f"machine: {os.cpu_count()} cores; 1-minute load {min(loads):.2f}-{max(loads):.2f} during the run; "
             f"CPU steal {steal_pct:.1f} %", "",
             "| measure | SQLite | PostgreSQL | PostgreSQL / SQLite (median of rounds) |", "|---|---|---|---|"]

    def ratio(metric) -> str:
        per_round = [metric(p) / metric(s) for s, p in zip(_rounds(results["sqlite"]), _rounds(results["postgresql"]))
                     if metric(s) > 0]
        return f"{statistics.median(per_round):.2f}" if per_round else "n/a"

    for kind in kinds:
        for q, name in ((0.5, "p50"), (0.95, "p95")):
            cells = [pct([x for lat in results[b]["lat"] for x in lat.get(kind, [])], q) * 1000 for b in ("sqlite", "postgresql")]
            lines.append(f"| API {kind} {name} (ms) | {cells[0]:.1f} | {cells[1]:.1f} | "
                         f"{ratio(lambda rnd, kind=kind, q=q: pct(rnd['lat'].get(kind, []), q) * 1000)} |")
    for q, name in ((0.5, "median"), (0.95, "p95")):
        cells = [pct([x for t in results[b]["run"] for x in t], q) for b in ("sqlite", "postgresql")]
        lines.append(f"| flow run overhead {name} (s) | {cells[0]:.3f} | {cells[1]:.3f} | "
                     f"{ratio(lambda rnd, q=q: pct(rnd['run'], q))} |")
    rates = [statistics.median(results[b]["rate"]) for b in ("sqlite", "postgresql")]
    lines.append(f"| flow runs per second, {args.procs} processes (wall from their start) | {rates[0]:.2f} | {rates[1]:.2f} | "
                 f"{ratio(lambda rnd: rnd['rate'])} |")
    totals: list[Counter[str]] = [sum(results[b]["err"], Counter()) for b in ("sqlite", "postgresql")]
    for at in sorted({k.split(" ", 1)[1] for tot in totals for k in tot if k.startswith("sent ")}):
        counts = []
        for tot in totals:
            failed_calls = {k.split(" ", 1)[0]: v for k, v in tot.items() if k.endswith(at) and not k.startswith("sent ")}
            words = ", ".join(f"{v} x {k}" for k, v in sorted(failed_calls.items())) or "none"
            counts.append(f"{sum(failed_calls.values())} of {tot.get(f'sent {at}', 0)} ({words})")
        lines.append(f"| API calls failed {at}, not retried | {counts[0]} | {counts[1]} | |")
    failed = [sum(results[b]["failed"]) for b in ("sqlite", "postgresql")]
    lines.append(f"| flow processes failed | {failed[0]} | {failed[1]} | |")
    return "\n".join(lines)


def _rounds(r: dict) -> list[dict]:
    return [{"lat": lat, "run": run, "rate": rate} for lat, run, rate in zip(r["lat"], r["run"], r["rate"])]


if __name__ == "__main__":
    sys.exit(main())
