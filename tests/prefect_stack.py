"""Helpers for tests that need a real `prefect server start` (and a worker): ports, environment, a receiver.

Ports come from 18300-18399 only (other suites own other ranges); each server gets its own
PREFECT_HOME (SQLite, lease files, logs) under the test's tmp folder, so nothing leaks into
~/.prefect or into another suite's limits.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

PORTS = range(18300, 18400)
_taken: set[int] = set()


def free_port() -> int:
    """A port in 18300-18399 nobody listens on (and this process has not handed out yet)."""
    for port in PORTS:
        if port in _taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError("no free port in 18300-18399")


def api_call(api: str, method: str, path: str, **kwargs) -> httpx.Response:
    """One call to a Prefect server's REST API, retrying its 503s as Prefect's own client does.

    The server answers 503 when SQLite was busy (`is_client_retryable_exception`): under a loaded
    CI machine the scheduler, the worker and a test all write at once, and the next try succeeds.
    """
    deadline = time.monotonic() + 60
    delay = 0.5
    while True:
        r = httpx.request(method, api + path, timeout=30, **kwargs)
        if r.status_code != 503 or time.monotonic() + delay > deadline:
            r.raise_for_status()
            return r
        time.sleep(delay)
        delay = min(delay * 2, 8.0)


@contextmanager
def prefect_server(home: Path, extra_env: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """A real Prefect server (no UI, fast scheduler loop); yields the environment its clients use."""
    from flows.deployments import prefect_env, server

    home.mkdir(parents=True, exist_ok=True)
    server_env = {"PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
                  "PREFECT_LOGGING_LEVEL": "WARNING", **(extra_env or {})}
    with server("127.0.0.1", free_port(), home, extra_env=server_env) as api_url:
        yield prefect_env(api_url, home, {"PREFECT_LOGGING_LEVEL": "WARNING", **(extra_env or {})})


class Receiver:
    """A local HTTP endpoint that keeps every JSON body POSTed to it (the notification target)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
