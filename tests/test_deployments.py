"""`lanebench serve`: prefect.yaml's deployments on a real `prefect server start` with a process worker.

The nightly deployment runs on its cron schedule (every minute here) through the scheduler and
the worker; the KL gate runs as a parameterised deployment. A cheap lane keeps it short.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import REPO, manifest_of, shipped_inventory, write_inventory
from prefect_stack import api_call, free_port

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _cheap_lane(folder: Path, port: int) -> Path:
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane["port"] = port
    lane["bench"] = {**lane["bench"], "repeats": 1, "decode": {**lane["bench"]["decode"], "concurrency": [1],
                                                               "max_tokens": 16}}
    lane["bench"].pop("acceptance")
    for bench in ("prefill", "accuracy", "capacity"):  # cheap lane: speed stages only
        lane["bench"].pop(bench, None)
    return write_inventory(folder, inv)


def _prefect_file(tmp: Path, hosts: Path, artifacts: Path) -> Path:
    """The shipped prefect.yaml with the nightly on a one-minute cron and pointed at the cheap lane."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly")
    nightly["schedules"] = [{"cron": "* * * * *", "timezone": "UTC", "active": True}]
    nightly["parameters"] = {"hosts": str(hosts), "artifacts_root": str(artifacts)}
    path = tmp / "prefect.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class _Lines:
    """A subprocess's output lines, readable with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._q.put(line) for line in proc.stdout], daemon=True).start()

    def until(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} after {timeout:.0f} s:\n" + "".join(self.lines)
            try:
                self.lines.append(self._q.get(timeout=min(left, 1.0)))
            except queue.Empty:
                continue


@pytest.fixture(scope="module")
def served(tmp_path_factory, llama_bin):
    tmp = tmp_path_factory.mktemp("serve")
    lane_port, api_port = free_port(), free_port()
    hosts = _cheap_lane(tmp / "inventory", lane_port)
    prefect_file = _prefect_file(tmp, hosts, tmp / "artifacts")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "LANEBENCH_NOTIFY_URL"}
    env |= {"PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
            "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--port", str(api_port), "--home",
                             str(tmp / "prefect-home"), "--prefect-file", str(prefect_file)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = _Lines(proc)
    try:
        out.until("Ctrl-C stops", 600)
        yield {"api": f"http://127.0.0.1:{api_port}/api", "tmp": tmp, "out": out, "lane_port": lane_port}
    finally:
        proc.send_signal(signal.SIGTERM)  # serve stops its worker, then its server
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _api(served: dict, method: str, path: str, **kwargs) -> httpx.Response:
    return api_call(served["api"], method, path, **kwargs)


def _deployment(served: dict, name: str) -> dict:
    deployments = _api(served, "POST", "/deployments/filter", json={}).json()
    return next(d for d in deployments if d["name"] == name)


def _wait_terminal(served: dict, flow_run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = _api(served, "GET", f"/flow_runs/{flow_run_id}").json()
        if run["state"]["type"] in TERMINAL:
            return run
        assert time.monotonic() < deadline, f"flow run still {run['state']['type']} after {timeout:.0f} s"
        time.sleep(2)


def test_every_deployment_is_registered_with_its_schedule_and_parameters(served):
    nightly, kl, matrix = (_deployment(served, n) for n in ("nightly", "kl", "matrix"))
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["* * * * *"]
    assert nightly["work_pool_name"] == "lanebench" and kl["work_pool_name"] == "lanebench"
    assert "kl_file" in kl["parameter_openapi_schema"]["required"]
    assert "matrix_file" in matrix["parameter_openapi_schema"]["required"]
    assert "regression" in nightly["parameter_openapi_schema"]["properties"]


def test_the_cron_schedule_runs_the_nightly_through_the_worker(served):
    dep = _deployment(served, "nightly")
    deadline = time.monotonic() + 150  # the next minute boundary, plus the scheduler's loop
    while True:
        runs = _api(served, "POST", "/flow_runs/filter", json={
            "deployments": {"id": {"any_": [dep["id"]]}}, "flow_runs": {"state": {"type": {"not_any_": ["SCHEDULED"]}}},
        }).json()
        if runs:
            break
        assert time.monotonic() < deadline, "no scheduled nightly was picked up by the worker"
        time.sleep(2)
    _api(served, "PATCH", f"/deployments/{dep['id']}", json={"paused": True})  # one night is enough
    run = _wait_terminal(served, runs[0]["id"], 420)
    assert run["auto_scheduled"] is True and run["state"]["type"] == "COMPLETED", run["state"]
    folder = next((served["tmp"] / "artifacts").glob(f"*_nightly_{run['id'][:8]}"))
    m = manifest_of(folder)
    assert m["flow"]["flow_run_id"] == run["id"] and m["lanes"]["rehearsal"]["status"] == "passed"
    assert m["lanes"]["rehearsal"]["host_lock"]["limit"] == "gpu:localhost"
    limit = _api(served, "GET", "/v2/concurrency_limits/gpu:localhost").json()
    assert limit["limit"] == 1 and limit["active_slots"] == 0
    artifacts = _api(served, "POST", "/artifacts/filter", json={"artifacts": {"key": {"any_": ["nightly-report"]}}})
    assert any(a["flow_run_id"] == run["id"] for a in artifacts.json())


def test_a_parameterised_deployment_gets_its_parameters(served):
    """The KL gate with a file that does not exist: the worker runs it, the flow reads the parameter
    and fails naming the file (a real KL run boots several lanes; the lane flows have their own tests)."""
    dep = _deployment(served, "kl")
    missing = str(served["tmp"] / "no-such-kl.yaml")
    created = _api(served, "POST", f"/deployments/{dep['id']}/create_flow_run",
                   json={"parameters": {"kl_file": missing}}).json()
    run = _wait_terminal(served, created["id"], 300)
    assert run["parameters"]["kl_file"] == missing
    assert run["state"]["type"] == "FAILED" and run["start_time"] is not None
    assert "no-such-kl.yaml" in (run["state"]["message"] or ""), run["state"]


def test_nothing_is_left_running_on_the_lane_port(served):
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and b"llama-server" in cmd[0]:
                assert str(served["lane_port"]).encode() not in cmd, cmd
