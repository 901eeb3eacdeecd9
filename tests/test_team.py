"""A team's lanebench: Prefect on PostgreSQL, two workers (one on another "machine"), one store.

Real parts only: a PostgreSQL cluster of the test's own (tests/pg_fixture.py), `lanebench serve
--database postgresql://...` listening on the lab's management bridge, its worker on queue
`site-a`, a second `prefect worker` inside the lab's spark1 namespace on queue `site-b`
talking to the server over the lab network, and the artifacts store on gb300 over sftp (the lab's
known_hosts, never trust on first use). A nightly and two matrices are launched at once through
the deployments; every lane of all three aims at the same host, so `gpu:localhost` must keep
them one at a time across both workers, checked from the hold spans each run folder recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from conftest import REPO, shipped_inventory, write_inventory
from prefect_stack import api_call, free_port
from test_deployments import _Lines

pytest_plugins = ["lab_fixture", "pg_fixture"]

LANE_PORTS = (18640, 18650)  # this file's lanes: nightly on 18640, matrix arms from 18650 (arms may move up)
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _inventory(folder: Path, port: int) -> Path:
    """The shipped rehearsal lane, cut to its speed stages at one concurrency: cheap and real."""
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane["port"] = port
    for ref in ("model", "drafter"):
        lane[ref].pop("bytes", None)
        lane[ref].pop("sha256", None)
    lane["bench"] = {**lane["bench"], "repeats": 1,
                     "decode": {**lane["bench"]["decode"], "concurrency": [1], "max_tokens": 16,
                                "requests_per_stream": 2, "requests_per_level": 2}}
    for bench in ("acceptance", "prefill", "accuracy", "capacity"):
        lane["bench"].pop(bench, None)
    lane.pop("correctness", None)  # the tool-call gate and needles have tests of their own
    inv["lanes"] = {"rehearsal": lane}
    return write_inventory(folder, inv)


def _matrix(folder: Path, inventory: Path, name: str) -> Path:
    """One drafter at one K (plus the no-speculation arm every matrix adds), one prompt a class."""
    data = yaml.safe_load((REPO / "matrix" / "rehearsal.yaml").read_text())
    models, prompts = REPO / "testbed" / "models", REPO / "testbed" / "prompts"
    data.update(
        name=name, inventory=str(inventory), baseline="good",
        drafters={"good": {**data["drafters"]["good"], "path": str(models / "drafter-good-f16.gguf")}},
        prompt_sets={c: str(prompts / Path(p).name) for c, p in data["prompt_sets"].items()},
        arms=[{"drafter": "good", "k": [4]}], prompts_per_class=1, max_tokens=16, repeats=1,
        speed={"prompt_set": "prose", "concurrency": [1], "max_tokens": 16, "requests_per_stream": 1},
        bars=[{"metric": "acceptance_length", "class": "code", "op": ">=", "value": 1.0}])
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def team(lab, postgres, llama_bin, tmp_path_factory):
    from lab.lab import HOSTS, ORCHESTRATOR

    tmp = tmp_path_factory.mktemp("team")
    database = postgres.create_database("prefect_team")
    store_dir = lab.host_dir("gb300") / "store"
    store_dir.mkdir(parents=True, exist_ok=True)
    store = f"sftp://root@{HOSTS['gb300']}{store_dir}"
    api_port = free_port()
    api = f"http://{ORCHESTRATOR}:{api_port}/api"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LANEBENCH_NOTIFY"))}
    base |= {"PREFECT_UI_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_LOGGING_LEVEL": "WARNING",
             "PYTHONUNBUFFERED": "1", "LANEBENCH_STORE_IDENTITY": str(lab.dir / "id_ed25519"),
             "LANEBENCH_STORE_KNOWN_HOSTS": str(lab.dir / "known_hosts")}
    side = {s: base | {"PREFECT_HOME": str(tmp / s / "prefect"), "LANEBENCH_STORE_MIRRORS": str(tmp / s / "mirrors")}
            for s in ("site-a", "site-b")}
    for s in side:
        (tmp / s / "prefect").mkdir(parents=True)
    served = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve", "--host", ORCHESTRATOR, "--port", str(api_port),
         "--database", database, "--home", str(tmp / "site-a" / "prefect"), "--work-queue", "site-a"],
        cwd=REPO, env=side["site-a"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    remote_worker = None
    try:
        _Lines(served).until("Ctrl-C stops", 300)
        # The other machine: a worker in spark1's namespace, reaching the server over the lab bridge.
        remote_worker = subprocess.Popen(
            ["ip", "netns", "exec", "spark1", sys.executable, "-m", "flows.cli", "worker", "--api-url", api,
             "--work-queue", "site-b", "--name", "spark1-worker"],
            cwd=REPO, env=side["site-b"], stdout=open(tmp / "spark1-worker.log", "wb"),
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not any(w["name"] == "spark1-worker" for w in
                      api_call(api, "POST", "/work_pools/lanebench/workers/filter", json={}).json()):
            assert remote_worker.poll() is None, (tmp / "spark1-worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the spark1 worker never reached the server"
            time.sleep(2)
        yield {"api": api, "store": store, "tmp": tmp, "env": side, "database": database, "postgres": postgres}
    finally:
        if remote_worker is not None:
            _stop(remote_worker)
        _stop(served)


def _launch(team: dict, deployment: str, queue: str, **parameters) -> str:
    """`lanebench launch` as a team member runs it: the run goes to the site's queue."""
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", deployment, "--work-queue", queue,
                           *[a for k, v in parameters.items() for a in ("--param", f"{k}={v}")]],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=team["env"]["site-a"] | {"PREFECT_API_URL": team["api"]})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split("(", 1)[1].split(")", 1)[0]


def _spans(manifest: dict) -> list[tuple[str, str, datetime, datetime]]:
    out = []
    for name, lane in manifest["lanes"].items():
        hold = lane.get("host_lock") or {}
        if hold.get("acquired_at") and hold.get("released_at"):
            out.append((manifest["flow"]["name"], name, datetime.fromisoformat(hold["acquired_at"]),
                        datetime.fromisoformat(hold["released_at"])))
    return out


def test_a_nightly_and_two_matrices_on_two_workers_share_one_history_and_one_host_at_a_time(team):
    tmp, api = team["tmp"], team["api"]
    inventory = _inventory(tmp / "inventory", LANE_PORTS[0])
    matrix_inv = _inventory(tmp / "matrix-inventory", LANE_PORTS[1])
    runs = {
        _launch(team, "nightly", "site-b", hosts=str(inventory), artifacts_root=team["store"]): "site-b",
        _launch(team, "matrix", "site-a", matrix_file=str(_matrix(tmp, matrix_inv, "team-a")),
                artifacts_root=team["store"]): "site-a",
        _launch(team, "matrix", "site-b", matrix_file=str(_matrix(tmp, matrix_inv, "team-b")),
                artifacts_root=team["store"]): "site-b",
    }
    deadline, done = time.monotonic() + 600, {}
    while len(done) < len(runs):
        assert time.monotonic() < deadline, f"still running after 600 s: {set(runs) - set(done)}"
        for run_id in set(runs) - set(done):
            run = api_call(api, "GET", f"/flow_runs/{run_id}").json()
            if run["state"]["type"] in TERMINAL:
                done[run_id] = run
        time.sleep(2)
    for run_id, run in done.items():
        assert run["state"]["type"] == "COMPLETED", (run["name"], run["state"]["message"],
                                                     (tmp / "spark1-worker.log").read_text()[-3000:])
    # Each run was taken by a worker of its own queue: the spark1 one ran the nightly and one matrix.
    queues = {r["id"]: api_call(api, "GET", f"/work_queues/{r['work_queue_id']}").json()["name"] for r in done.values()}
    assert queues == runs
    # ... and taken by that queue's worker: each worker's submitted-flow-run event names it.
    deadline, taken_by = time.monotonic() + 60, {}
    while set(taken_by) < set(runs) and time.monotonic() < deadline:
        events = api_call(api, "POST", "/events/filter", json={
            "filter": {"event": {"name": ["prefect.worker.submitted-flow-run"]}}, "limit": 50}).json()["events"]
        taken_by = {r["prefect.resource.id"].removeprefix("prefect.flow-run."): e["resource"]["prefect.resource.name"]
                    for e in events for r in e["related"] if r.get("prefect.resource.role") == "flow-run"}
        time.sleep(2)
    for run_id, queue in runs.items():
        assert (taken_by.get(run_id) == "spark1-worker") == (queue == "site-b") and run_id in taken_by, (queue, taken_by)

    # The server really is on PostgreSQL: the flow runs are rows there.
    count = subprocess.run(["psql", team["database"], "-tAc", "SELECT count(*) FROM flow_run"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert int(count) >= 3

    # One history from either side: the store's runs, listed from here and from inside spark1.
    history = [sys.executable, "-m", "flows.cli", "history", "--artifacts", team["store"], "--csv"]
    seen = {}
    for side, prefix in (("site-a", []), ("site-b", ["ip", "netns", "exec", "spark1"])):
        out = subprocess.run([*prefix, *history], capture_output=True, text=True, cwd=REPO, timeout=300,
                             env=team["env"][side])
        assert out.returncode == 0, out.stderr[-2000:]
        seen[side] = out.stdout
    for run_id in runs:
        assert run_id[:8] in seen["site-a"] and run_id[:8] in seen["site-b"], (run_id, seen)

    spans = []
    store_dir = Path(urlsplit(team["store"]).path)
    assert not any((store_dir / ".incoming").iterdir())  # every publish finished with its rename
    for run_id in runs:
        folder = next(store_dir.glob(f"*_{run_id[:8]}"))
        verify = subprocess.run([sys.executable, "-m", "flows.cli", "verify", f"{team['store']}/{folder.name}"],
                                capture_output=True, text=True, cwd=REPO, timeout=300, env=team["env"]["site-a"])
        assert verify.returncode == 0 and verify.stdout.startswith("ok:"), verify.stdout + verify.stderr
        spans += _spans(json.loads((folder / "manifest.json").read_text()))
    # nightly: 1 lane; each matrix: its arm and the no-speculation arm
    assert len(spans) == 5, spans
    spans.sort(key=lambda s: s[2])
    for before, after in zip(spans, spans[1:]):
        assert before[3] <= after[2], f"{before[:2]} held gpu:localhost until {before[3]}, {after[:2]} from {after[2]}"


@pytest.mark.parametrize("url, words", [
    ("mysql://u@db/prefect", "scheme 'mysql' is not supported"),
    ("postgresql://u:secret@/prefect", "needs a host and a database name"),
])
def test_a_database_prefect_cannot_use_is_one_line_and_exit_2(url, words):
    done = subprocess.run([sys.executable, "-m", "flows.cli", "serve", "--database", url], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "secret" not in done.stderr  # a password never reaches a message
