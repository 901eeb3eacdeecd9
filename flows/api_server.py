"""The Prefect API server a CLI run talks to, started in its own session so Ctrl-C spares it.

Prefect's ephemeral server shares lanebench's process group, so Ctrl-C kills it first and the
run retries a dead API while it should tear down. This runs the same uvicorn command in a new
session for the run; PR_SET_PDEATHSIG stops it if lanebench is killed. With PREFECT_API_URL set,
that server is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


PR_SET_PDEATHSIG = 1


def _own_session_dying_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch() -> tuple[subprocess.Popen, str] | None:
    """Start the server now, before Prefect (~2 s to import), GX or the flows: its boot overlaps
    theirs. None when PREFECT_API_URL names a server; one in a profile is seen later (`api_server`)."""
    import importlib.util

    if os.environ.get("PREFECT_API_URL"):
        return None
    from tasks.hosts.lock_storage import use_file_leases

    use_file_leases()  # the host lock's leases, read by the server at its start
    spec = importlib.util.find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        return None
    port = _free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # never a telemetry call, whoever launches it
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.submodule_search_locations[0]).parent),
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_own_session_dying_with_parent)
    return proc, f"http://127.0.0.1:{port}/api"


def stop(launched: tuple[subprocess.Popen, str] | None) -> None:
    """Stop a launched server (its own session, so its process group): `lanebench serve`'s stop."""
    if launched is not None:
        from flows.deployments import stop as stop_group

        stop_group(launched[0], grace_s=10)


@contextlib.contextmanager
def api_server(launched: tuple[subprocess.Popen, str] | None) -> Iterator[str | None]:
    """Run the body against the server `launch` started, or the configured one (None)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    if launched is None or get_current_settings().api.url:  # none launched, or one in Prefect's profile or prefect.toml
        stop(launched)
        yield None
        return
    proc, url = launched
    timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    try:
        from flows.deployments import wait_healthy

        wait_healthy(url, proc, timeout_s, poll_s=0.1)  # the same wait `lanebench serve` uses
        os.environ["PREFECT_API_URL"] = url  # for subprocesses (tests, tools) started by this run
        # No flow-run heartbeats (this server stops with the run): each flow run's exit waits for
        # their thread's 1 s sleep, measured at 0.56 s a lane.
        with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        with contextlib.suppress(Exception):  # the run's last log lines and events reach the API before it stops
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)
        with contextlib.suppress(Exception):
            from prefect.events.worker import EventsWorker

            EventsWorker.drain_all(timeout=5)
        stop(launched)
