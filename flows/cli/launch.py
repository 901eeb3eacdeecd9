"""`lanebench launch DEPLOYMENT [--work-queue Q] [--param k=v ...] [--wait]`: one run of a deployment
on a running server (PREFECT_API_URL), sent to a site's queue.

`prefect deployment run` cannot name a work queue, and a team routes runs by queue (one per site
or host group, each taken by the workers there: docs/nightly.md, "A team's set-up"). This is
Prefect's own create-flow-run call with `work_queue_name`; the server, the queues and the
workers stay Prefect's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


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
        while (state := client.read_flow_run(run.id).state) is None or state.type.value not in TERMINAL:
            time.sleep(2)
        print(f"{state.type.value}: {state.message or ''}".rstrip())
        return 0 if state.type.value == "COMPLETED" else 1


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("launch", help="one run of a deployment on the server PREFECT_API_URL names, "
                                             "sent to a work queue (a site's workers)")
    p.add_argument("deployment", help="deployment name: nightly, matrix, kl")
    p.add_argument("--work-queue", default=None, help="queue of the deployment's pool (default: the deployment's)")
    p.add_argument("--param", action="append", help="flow parameter KEY=VALUE (repeatable; JSON values are parsed)")
    p.add_argument("--wait", action="store_true", help="wait for the run; exit 0 when it completed, else 1")
    p.set_defaults(func=cmd_launch)
