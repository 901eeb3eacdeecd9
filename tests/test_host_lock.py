"""One job per GPU host, on a real Prefect server: two flows aimed at one host run one after the other,
and a holder that is killed does not keep the host forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime

import pytest

from conftest import REPO
from prefect_stack import api_call, prefect_server

# A flow that holds a host for a while and prints its Hold as JSON (the nightly wraps lanes the same way).
_HOLDER = """
import json, sys, time
from prefect import flow
from tasks.hosts.lock import host_lock

@flow(name="hold-host")
def hold(host: str, seconds: float) -> dict:
    with host_lock(host) as h:
        print("ACQUIRED", flush=True)
        time.sleep(seconds)
    return h.model_dump()

print("HOLD " + json.dumps(hold(sys.argv[1], float(sys.argv[2]))), flush=True)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as env:
        yield env


def _holder(env: dict, host: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _HOLDER, host, str(seconds)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _hold_of(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out + err
    return json.loads(next(line for line in out.splitlines() if line.startswith("HOLD "))[5:])


def _limit(env: dict, name: str) -> dict:
    return api_call(env["PREFECT_API_URL"], "GET", f"/v2/concurrency_limits/{name}").json()


def test_two_flows_on_one_host_run_one_after_the_other(stack):
    host = f"box-{uuid.uuid4().hex[:6]}"
    procs = [_holder(stack, host, 6.0) for _ in range(2)]
    holds = sorted((_hold_of(p, 240) for p in procs), key=lambda h: h["acquired_at"])
    first, second = holds
    t = {k: [datetime.fromisoformat(h[k]) for h in holds] for k in ("acquired_at", "released_at")}
    # The hold intervals do not overlap: the second got the host only after the first let go.
    assert t["acquired_at"][1] >= t["released_at"][0], holds
    assert (t["released_at"][0] - t["acquired_at"][0]).total_seconds() >= 6.0
    assert second["waited_s"] > first["waited_s"]
    limit = _limit(stack, f"gpu:{host}")  # created on first use, one slot, handed back
    assert limit["limit"] == 1 and limit["active_slots"] == 0, limit


def test_a_killed_holder_does_not_keep_the_host_on_the_ephemeral_server(tmp_path):
    """SIGKILL skips every finally: the slot stays taken until its lease expires, and the ephemeral
    server runs no repossessor. The lease names its holder, whose process is written beside the
    lease files: the next job sees that process is gone and hands the slot back at once."""
    host = f"box-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(tmp_path / "home"), "LANEBENCH_HOST_LEASE_S": "60", "DO_NOT_TRACK": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    victim = _holder(env, host, 600)
    try:
        deadline = time.monotonic() + 180
        while victim.stdout.readline().strip() != "ACQUIRED":
            assert time.monotonic() < deadline and victim.poll() is None, victim.stderr.read()
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
    started = time.monotonic()
    hold = _hold_of(_holder(env, host, 0.5), 300)
    assert hold["reclaimed"] == 1, hold
    assert hold["waited_s"] < 15  # released at once: no wait for the dead holder's lease to run out
    assert time.monotonic() - started < 120
