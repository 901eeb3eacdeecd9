"""Issue 29's load: four matrices and a nightly launched at once, two workers, one Prefect server on
PostgreSQL, with no 503 retried anywhere (PREFECT_CLIENT_MAX_RETRIES=0 in every client).

tests/test_team.py's stack at the issue's size (docs/benchmarks.md: what runs where). Exits 1
unless every run COMPLETED, each by a worker of its own queue, each with one run folder that
`lanebench verify` passes, and no two lanes held `gpu:localhost` at once.

    uv run python benchmarks/team_load.py [--matrices 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO

sys.path.insert(0, str(REPO / "tests"))
from pg_fixture import Cluster  # the tests' real PostgreSQL, reused
from prefect_stack import free_port
from test_deployments import _Lines
from test_team import TERMINAL, _inventory, _launch, _matrix, _spans, _stop  # the CI test's lanes

from tasks.record.manifest import read_manifest

NIGHTLY_PORT, MATRIX_PORT = 18770, 18780  # this script's lanes (the matrix's arms may move up)


def _get(api: str, path: str) -> dict:
    import httpx

    r = httpx.get(api + path, timeout=30)  # no retry: a 503 here fails the benchmark
    r.raise_for_status()
    return r.json()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrices", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lanebench-teamload-"))
    os.chmod(root, 0o755)
    (root / "pg").mkdir()
    cluster = Cluster(root / "pg")
    served = other = None
    problems: list[str] = []
    try:
        cluster.start()
        database = cluster.create_database("prefect_team_load")
        store = root / "store"
        store.mkdir()
        api = f"http://127.0.0.1:{free_port()}/api"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LANEBENCH_NOTIFY"))}
        base |= {"PREFECT_UI_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_LOGGING_LEVEL": "WARNING",
                 "PYTHONUNBUFFERED": "1", "PREFECT_CLIENT_MAX_RETRIES": "0"}
        side = {s: base | {"PREFECT_HOME": str(root / s / "prefect")} for s in ("site-a", "site-b")}
        for s in side:
            (root / s / "prefect").mkdir(parents=True)
        port = api.rsplit(":", 1)[1].split("/")[0]
        served = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "serve", "--host", "127.0.0.1", "--port", port, "--database", database,
             "--home", str(root / "site-a" / "prefect"), "--work-queue", "site-a"],
            cwd=REPO, env=side["site-a"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        _Lines(served).until("Ctrl-C stops", 600)
        other = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "worker", "--api-url", api, "--work-queue", "site-b", "--name", "worker-b"],
            cwd=REPO, env=side["site-b"], stdout=open(root / "worker-b.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
        team = {"api": api, "env": side}
        inventory = _inventory(root / "inventory", NIGHTLY_PORT)
        matrix_inv = _inventory(root / "matrix-inventory", MATRIX_PORT)
        load_before, t0 = os.getloadavg()[0], time.monotonic()
        runs = {_launch(team, "nightly", "site-b", hosts=str(inventory), artifacts_root=str(store)): "site-b"}
        for i in range(args.matrices):
            queue = ("site-a", "site-b")[i % 2]
            name = f"team-load-{chr(ord('a') + i)}"
            runs[_launch(team, "matrix", queue, matrix_file=str(_matrix(root, matrix_inv, name)),
                         artifacts_root=str(store))] = queue
        done: dict[str, dict] = {}
        loads = [load_before]
        while len(done) < len(runs) and time.monotonic() - t0 < args.timeout:
            for run_id in set(runs) - set(done):
                run = _get(api, f"/flow_runs/{run_id}")
                if run["state"]["type"] in TERMINAL:
                    done[run_id] = run
            loads.append(os.getloadavg()[0])
            time.sleep(5)
        wall = time.monotonic() - t0
        for run_id in set(runs) - set(done):
            problems.append(f"run {run_id} not finished after {args.timeout:.0f} s (lost?)")
        spans, rows = [], []
        for run_id, run in done.items():
            queue = _get(api, f"/work_queues/{run['work_queue_id']}")["name"]
            if run["state"]["type"] != "COMPLETED":
                problems.append(f"{run['name']} ({run_id[:8]}): {run['state']['type']}: {run['state'].get('message')}")
            if queue != runs[run_id]:
                problems.append(f"{run_id[:8]} ran from queue {queue}, launched to {runs[run_id]}")
            folders = list(store.glob(f"*_{run_id[:8]}"))
            if len(folders) != 1:
                problems.append(f"{run_id[:8]}: {len(folders)} run folders in the store")
                continue
            verify = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(folders[0])], capture_output=True,
                                    text=True, cwd=REPO, timeout=300, env=side["site-a"])
            if verify.returncode != 0:
                problems.append(f"verify {folders[0].name}: {verify.stdout.strip()[:300]}")
            manifest = read_manifest(folders[0]).model_dump(mode="json")  # as the CI test's _spans reads it
            spans += _spans(manifest)
            waits = [(lane.get("host_lock") or {}).get("waited_s") or 0.0 for lane in manifest["lanes"].values()]
            rows.append((manifest["flow"]["name"], queue, run.get("total_run_time") or 0.0, sum(waits), len(waits)))
        spans.sort(key=lambda s: s[2])
        for before, after in zip(spans, spans[1:]):
            if before[3] > after[2]:
                problems.append(f"{before[:2]} held gpu:localhost until {before[3]}, {after[:2]} from {after[2]}")
        if len(spans) != 1 + 2 * args.matrices:
            problems.append(f"{len(spans)} lane hold spans, expected {1 + 2 * args.matrices}")
        print(f"## Team load: a nightly and {args.matrices} matrices, 2 workers, Prefect on PostgreSQL\n")
        print(f"machine: {os.cpu_count()} cores; 1-minute load {min(loads):.2f}-{max(loads):.2f} (before: "
              f"{load_before:.2f}); Prefect client retries off (PREFECT_CLIENT_MAX_RETRIES=0)\n")
        print("| run | queue | flow run wall (s) | host-lock wait, its lanes (s) | lanes |\n|---|---|---|---|---|")
        for name, queue, run_wall, wait, lanes in sorted(rows):
            print(f"| {name} | {queue} | {run_wall:.0f} | {wait:.0f} | {lanes} |")
        print(f"\nall {len(runs)} runs: {wall:.0f} s from the first launch to the last end; "
              f"{len(spans)} lane holds, {'none overlapping' if not any('held' in p for p in problems) else 'OVERLAPPING'}; "
              f"{sum(1 for r in done.values() if r['state']['type'] == 'COMPLETED')}/{len(runs)} completed")
    finally:
        for proc in (other, served):
            if proc is not None:
                _stop(proc)
        cluster.stop()
    for p in problems:
        print(f"PROBLEM: {p}")
    if not problems:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"(kept for inspection: {root})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
