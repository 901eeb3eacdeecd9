"""The Prefect API server a CLI run talks to, started in its own session so Ctrl-C spares it.

Prefect's ephemeral server is a child in lanebench's own process group: the SIGINT a terminal
sends to the whole group on Ctrl-C kills it first, and the run then retries a dead API while
it should be tearing down. This starts the same server (the same uvicorn command Prefect's
`SubprocessASGIServer` runs, so startup costs the same) in a new session, points
PREFECT_API_URL at it for the run, and stops it when the run ends. The kernel stops it too if
lanebench itself is killed (PR_SET_PDEATHSIG), so a SIGKILLed run leaves no server behind.
With PREFECT_API_URL already set, that server is used and nothing is started.
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
    """Start the server process now, before Prefect, GX or the flows are imported: its seconds
    of booting then overlap theirs on the other core. None when PREFECT_API_URL names a server.

    Nothing of Prefect is imported here (that alone is ~2 s); a server configured in a profile
    or a prefect.toml is seen once Prefect is imported, and `api_server` then stops this one.
    """
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


def _configured_elsewhere() -> bool:
    """A server named in Prefect's profile or prefect.toml (visible once Prefect is imported)."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def stop(launched: tuple[subprocess.Popen, str] | None) -> None:
    """Stop a launched server (its own session, so its process group): `lanebench serve`'s stop."""
    if launched is not None:
        from flows.deployments import stop as stop_group

        stop_group(launched[0], grace_s=10)


@contextlib.contextmanager
def api_server(launched: tuple[subprocess.Popen, str] | None = None, timeout_s: float | None = None
               ) -> Iterator[str | None]:
    """Run the body against a Prefect server of its own (`launched`, or launched now), or the
    configured one (yields None)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    launched = launched or launch()
    if launched is not None and _configured_elsewhere():
        stop(launched)
        launched = None
    if launched is None:
        yield None
        return
    proc, url = launched
    timeout_s = timeout_s or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    try:
        from flows.deployments import wait_healthy

        wait_healthy(url, proc, timeout_s, poll_s=0.1)  # the same wait `lanebench serve` uses
        os.environ["PREFECT_API_URL"] = url  # for subprocesses (tests, tools) started by this run
        # No flow-run heartbeats: they tell a long-lived server that a run is alive, and this one
        # stops with the run. Their thread sleeps in 1 s steps and each flow run's exit waits for
        # it: up to a second per flow run (the nightly and each lane), measured at 0.56 s a lane.
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
