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
    """Start the server process now (it boots while the flow modules import); None when
    PREFECT_API_URL names a server already."""
    import prefect
    from prefect.settings import get_current_settings

    if os.environ.get("PREFECT_API_URL") or get_current_settings().api.url:
        return None
    port = _free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_own_session_dying_with_parent)
    return proc, f"http://127.0.0.1:{port}/api"


@contextlib.contextmanager
def api_server(launched: tuple[subprocess.Popen, str] | None = None, timeout_s: float | None = None
               ) -> Iterator[str | None]:
    """Run the body against a Prefect server of its own (`launched`, or launched now), or the
    configured one (yields None)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    launched = launched or launch()
    if launched is None:
        yield None
        return
    proc, url = launched
    timeout_s = timeout_s or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    try:
        from flows.deployments import wait_healthy

        wait_healthy(url, proc, timeout_s, poll_s=0.1)  # the same wait `lanebench serve` uses
        os.environ["PREFECT_API_URL"] = url  # for subprocesses (tests, tools) started by this run
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        with contextlib.suppress(Exception):  # the run's last log lines and events reach the API before it stops
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)
        with contextlib.suppress(Exception):
            from prefect.events.worker import EventsWorker

            EventsWorker.drain_all(timeout=5)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
