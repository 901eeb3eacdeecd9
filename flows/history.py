"""`lanebench history` (questions to the run history), `verify` (a run folder against its manifest),
and a team's commands: `serve` (deployments on a real server), `worker`, `launch`.

Every history query rebuilds the index from the run folders first (they are the source of truth):
a rich table by default, `--csv` for machines. Cheap to import: DuckDB, pandas and Prefect are
imported when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_SHORT = ("git_sha", "model_sha256", "drafter_sha256", "engine_sha256", "inventory_sha256", "config_sha256")


def _print(df: Any, csv: bool, title: str) -> None:
    if csv:
        df.to_csv(sys.stdout, index=False)
        return
    import pandas as pd
    from rich.console import Console
    from rich.table import Column, Table

    shown = df.copy()
    for col in shown.columns:
        if col in _SHORT:
            shown[col] = [v[:12] if isinstance(v, str) else v for v in shown[col]]
        elif col == "image":
            shown[col] = [v[-12:] if isinstance(v, str) else v for v in shown[col]]
        elif col in ("engine_source", "launch_command", "reason", "config"):
            shown[col] = [v if not isinstance(v, str) or len(v) <= 48 else v[:45] + "..." for v in shown[col]]
        if pd.api.types.is_datetime64_any_dtype(shown[col]):
            shown[col] = shown[col].dt.strftime("%Y-%m-%d %H:%M:%S")
    table = Table(*[Column(str(c), overflow="fold") for c in shown.columns], title=title, title_justify="left")
    for row in shown.itertuples(index=False):
        table.add_row(*["" if v is None or (isinstance(v, float) and v != v) else
                        f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    Console(width=max(160, 20 * len(shown.columns))).print(table)


def cmd_history(args: argparse.Namespace) -> int:
    from flows.cli import _bad_input
    from tasks.record import history
    from tasks.record.store import Store, StoreError, is_url

    if is_url(args.artifacts):  # a team's store: its published run folders, mirrored and checked here
        try:
            root = Store(args.artifacts).sync(on_refused=lambda line: print(f"history: {line}", file=sys.stderr))
        except StoreError as e:
            return _bad_input(str(e))
    else:
        root = Path(args.artifacts)
    if not root.is_dir():
        return _bad_input(f"--artifacts {root}: no such folder. Fix: pass the folder that holds the run folders")
    what = args.what or "runs"
    if what == "reindex":
        print(f"index written: {history.reindex(root)}")
        return 0
    con = history.open_index(root)
    for run, path, reason in con.execute("SELECT run, path, reason FROM refused").fetchall():
        print(f"history: refused {run}/{path}: {reason}; its numbers are not served "
              f"(lanebench verify {root / run})", file=sys.stderr)
    if what == "runs":
        _print(history.list_runs(con, args.flow, args.last), args.csv, f"runs under {root}")
    elif what == "metric":
        df = history.metric_history(con, args.lane, args.metric, args.last, args.flow)
        if df.empty:
            return _bad_input(f"no values of {args.metric} for lane {args.lane} under {root}. "
                              "Fix: see `lanebench history metrics` for the lanes and metric names there are")
        _print(df, args.csv, f"{args.lane} {args.metric}, last {len(df)} runs")
    elif what == "metrics":
        _print(history.available_metrics(con, args.lane), args.csv, "metrics in the history")
    elif what in ("matrix", "provenance"):
        run = history.resolve_run(con, args.run, "matrix" if what == "matrix" else None)
        if run is None:
            return _bad_input(f"run {args.run or '(latest matrix)'}: no such run (or not unique) under {root}. "
                              "Fix: pass a run folder name or its short flow-run id, see `lanebench history runs`")
        if what == "matrix":
            _print(history.matrix_runs(con, run), args.csv, f"matrix {run}")
        else:
            _print(history.provenance(con, run, args.lane), args.csv, f"what produced {run}")
    elif what == "sql":
        _print(con.execute(args.query).df(), args.csv, args.query)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from flows.cli import _bad_input
    from tasks.record.audit import audit
    from tasks.record.store import is_url

    if is_url(args.run):
        return _verify_in_store(args.run)
    run = Path(args.run)
    if not (run / "manifest.json").is_file():
        return _bad_input(f"{run}: no manifest.json there. Fix: pass a run folder, e.g. artifacts/<time>_nightly_<id>")
    result = audit(run)
    return _print_audit(result, result.problems, f", {len(result.problems)} problems" if result.problems else "")


def _verify_in_store(address: str) -> int:
    """`verify sftp://host/root/RUN`: the run folder as the store holds it, downloaded unchecked
    and audited against its manifest like a local one."""
    import tempfile

    from flows.cli import _bad_input
    from tasks.record.audit import audit
    from tasks.record.store import Store, StoreError

    root, _, name = address.rstrip("/").rpartition("/")
    try:
        store = Store(root)
        if name not in store.published():
            return _bad_input(f"{address}: no such run folder in the store. Fix: lanebench history --artifacts {root}")
        with tempfile.TemporaryDirectory(prefix="lanebench-verify-") as tmp:
            result = audit(store.download(name, Path(tmp)))
    except StoreError as e:
        return _bad_input(str(e))
    return _print_audit(result, [], f" ({address})", ledger=False)


def _print_audit(result: Any, problems: list[str], tail: str, ledger: bool = True) -> int:
    """The audit's findings, then its verdict line; returns the exit code."""
    for kind in ("missing", "changed", "extra"):
        for rel in getattr(result, kind):
            print(f"{kind}: {rel}")
    for line in problems:
        print(f"problem: {line}")
    print(f"{'ok' if result.ok else 'FAILED'}: {result.checked} files listed in the manifest, {len(result.missing)} "
          f"missing, {len(result.changed)} changed, {len(result.extra)} extra{tail}")
    if ledger and result.ledger:  # after the verdict line, which a good folder's output starts with
        print(f"ledger: {result.ledger}")
    return 0 if result.ok else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from flows.cli import _bad_input, _quiet_prefect
    from flows.deployments import DatabaseUrlError, connection_url, serve

    if args.database:
        if args.api_url:
            return _bad_input("--database with --api-url: the running server already has its database. "
                              "Fix: drop one of them")
        try:
            connection_url(args.database)
        except DatabaseUrlError as e:
            return _bad_input(str(e))
    _quiet_prefect()  # serve starts a real server of its own
    return serve(args.host, args.port, Path(args.home) if args.home else None, Path(args.prefect_file), args.pool,
                 args.api_url, start_worker=not args.no_worker, database=args.database,
                 queues=args.work_queue or None)


def cmd_worker(args: argparse.Namespace) -> int:
    """The pool and its queues made if missing, then `prefect worker start` in this process's place."""
    from flows.cli import _bad_input, _quiet_prefect

    api = args.api_url or os.environ.get("PREFECT_API_URL")
    if not api:
        return _bad_input("worker: no server. Fix: --api-url http://SERVER:4200/api (or PREFECT_API_URL)")
    _quiet_prefect()
    from flows.deployments import ensure_pool, prefect_env, wait_healthy, worker_args
    from tasks.inventory.paths import REPO

    env = prefect_env(api)
    wait_healthy(api, None, 60)
    ensure_pool(env, args.pool, args.work_queue)
    os.chdir(REPO)
    os.execve(sys.executable, [sys.executable, "-m", "prefect", *worker_args(args.pool, args.work_queue, args.name)], env)


def _params(pairs: list[str]) -> dict[str, Any] | str:
    """k=v pairs; a value that parses as JSON is taken as JSON (numbers, lists), else as text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            return f"--param {pair}: not KEY=VALUE. Fix: e.g. --param matrix_file=matrix/rehearsal.yaml"
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def cmd_launch(args: argparse.Namespace) -> int:
    """One run of a deployment on the server PREFECT_API_URL names, sent to a site's work queue, which
    `prefect deployment run` cannot name (docs/nightly.md, "A team's set-up")."""
    from flows.cli import _bad_input

    api = os.environ.get("PREFECT_API_URL")
    if not api:
        return _bad_input("PREFECT_API_URL is not set: launch needs the team's server. "
                          "Fix: export PREFECT_API_URL=http://SERVER:4200/api")
    params = _params(args.param or [])
    if isinstance(params, str):
        return _bad_input(params)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        name = args.deployment.rpartition("/")[2]  # `matrix` or Prefect's `matrix/matrix`
        found = [d for d in client.read_deployments() if d.name == name]
        if len(found) != 1:
            names = sorted({d.name for d in client.read_deployments()})
            return _bad_input(f"deployment {args.deployment}: {'not found' if not found else 'not unique'} on {api}. "
                              f"Fix: one of {', '.join(names) or '(none: run lanebench serve)'}")
        deployment = found[0]
        if args.work_queue:
            queues = [q.name for q in client.read_work_queues(work_pool_name=deployment.work_pool_name)]
            if args.work_queue not in queues:
                return _bad_input(f"--work-queue {args.work_queue}: no such queue in pool {deployment.work_pool_name}. "
                                  f"Fix: one of {', '.join(sorted(queues))}, or start its worker first "
                                  f"(lanebench worker --work-queue {args.work_queue})")
        run = client.create_flow_run_from_deployment(deployment.id, parameters=params,
                                                     work_queue_name=args.work_queue)
        print(f"flow run {run.name} ({run.id}) of {deployment.name} on queue "
              f"{args.work_queue or deployment.work_queue_name}", flush=True)
        if not args.wait:
            return 0
        while (state := client.read_flow_run(run.id).state) is None or not state.is_final():
            time.sleep(2)
        print(f"{state.type.value}: {state.message or ''}".rstrip())
        return 0 if state.type.value == "COMPLETED" else 1


def register_cli(subparsers: Any) -> None:
    from tasks.inventory.paths import REPO

    p = subparsers.add_parser("history", help="query the run history (DuckDB over every run folder)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help="folder that holds the run folders, or a store URL (sftp://host/path)")
    p.add_argument("--csv", action="store_true", help="CSV on stdout instead of a table")
    p.add_argument("--last", type=int, default=20, help="at most this many runs (default 20)")
    p.add_argument("--flow", default=None, help="only runs of this flow (nightly, matrix, kl)")
    p.set_defaults(func=cmd_history, what=None)
    sub = p.add_subparsers(dest="what")
    sub.add_parser("runs", help="the last runs, newest last")
    q = sub.add_parser("metric", help="a metric of a lane over its last N runs, with what produced each value")
    q.add_argument("lane")
    q.add_argument("metric", help="e.g. tok_s@c4, ttft_p95_s@c1, acceptance_length@code (see `history metrics`)")
    q = sub.add_parser("metrics", help="the lanes and metric names in the history")
    q.add_argument("--lane", default=None)
    q = sub.add_parser("matrix", help="the arms of a matrix run side by side (default: the latest matrix run)")
    q.add_argument("run", nargs="?", default=None, help="run folder name or short flow-run id")
    q = sub.add_parser("provenance", help="lanebench SHA, image digest, model/drafter sha256 and binary of a run")
    q.add_argument("run", help="run folder name or short flow-run id")
    q.add_argument("--lane", default=None)
    q = sub.add_parser("sql", help="any SQL on the index (tables runs, lanes, artifacts, decode, acceptance, "
                                   "kl_summary, regression; view metrics)")
    q.add_argument("query")
    sub.add_parser("reindex", help="write the index to <artifacts>/.history.duckdb")
    for q in sub.choices.values():  # the shared options also after the subcommand
        for flag, kw in (("--artifacts", {}), ("--csv", {"action": "store_true"}), ("--last", {"type": int}),
                         ("--flow", {})):
            q.add_argument(flag, default=argparse.SUPPRESS, **kw)

    p = subparsers.add_parser("serve", help="run the prefect.yaml deployments on a real Prefect server with a worker")
    p.add_argument("--host", default="127.0.0.1", help="server address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=4200, help="server port (default 4200)")
    p.add_argument("--home", default=None, help="PREFECT_HOME for the server's SQLite database and the logs")
    p.add_argument("--api-url", default=None, help="use this running Prefect server instead of starting one")
    p.add_argument("--prefect-file", default=str(REPO / "prefect.yaml"))
    p.add_argument("--pool", default="lanebench", help="process work pool (created when missing)")
    p.add_argument("--no-worker", action="store_true", help="deploy only; run a worker elsewhere")
    p.add_argument("--database", default=None, help="postgresql://USER[:PW]@HOST[:PORT]/DB for a team's server "
                   "(default: SQLite under --home); docs/nightly.md, 'A team's set-up'")
    p.add_argument("--work-queue", action="append", help="the worker takes only this queue of the pool (repeatable)")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("worker", help="a process worker for a team's server, on this machine (a site's queues)")
    p.add_argument("--api-url", default=None, help="the team's server (default: PREFECT_API_URL)")
    p.add_argument("--pool", default="lanebench", help="process work pool (created when missing)")
    p.add_argument("--work-queue", action="append", help="take only this queue (repeatable; created when missing)")
    p.add_argument("--name", default=None, help="the worker's name in the UI (default: Prefect's)")
    p.set_defaults(func=cmd_worker)

    p = subparsers.add_parser("verify", help="check every file of a run folder against the sha256 in its manifest")
    p.add_argument("run", help="the run folder (a path, or its address in a store: sftp://host/root/RUN)")
    p.set_defaults(func=cmd_verify)

    p = subparsers.add_parser("launch", help="one run of a deployment on the server PREFECT_API_URL names, "
                                             "sent to a work queue (a site's workers)")
    p.add_argument("deployment", help="deployment name: nightly, matrix, kl")
    p.add_argument("--work-queue", default=None, help="queue of the deployment's pool (default: the deployment's)")
    p.add_argument("--param", action="append", help="flow parameter KEY=VALUE (repeatable; JSON values are parsed)")
    p.add_argument("--wait", action="store_true", help="wait for the run; exit 0 when it completed, else 1")
    p.set_defaults(func=cmd_launch)
