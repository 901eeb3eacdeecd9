"""The API key a lane's server demands, as every client of that server sends it.

A lane with a key (`api_key_env` / `api_key_file`, tasks/inventory/api_key.py) starts its server with
the key in the engine's own environment variable, never on its argv; every request to that server
carries `Authorization: Bearer <key>` (the OpenAI convention llama-server, vLLM and SGLang read). The
key lives only here, by the server's `host:port`, while the server is up: no Endpoint, Prefect
parameter, record or log holds it. Wave worker processes (tasks/client/workers.py) get a copy.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import httpx

_keys: dict[str, str] = {}  # "host:port" -> the key its server demands
_lock = threading.Lock()


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or ''}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def serve_with(base_url: str, key: str | None) -> None:
    """The server at `base_url` demands `key` from now on (None: it demands none)."""
    with _lock:
        if key:
            _keys[origin(base_url)] = key
        else:
            _keys.pop(origin(base_url), None)


def forget(base_url: str) -> None:
    serve_with(base_url, None)


def headers(url: str) -> dict[str, str]:
    """The header a request to `url` carries (empty where its server demands no key)."""
    key = _keys.get(origin(url))
    return {"Authorization": f"Bearer {key}"} if key else {}


def header_bytes(host: str, port: int) -> bytes:
    """The same header as raw HTTP/1.1 head lines, for the load generator's own client."""
    key = _keys.get(f"{host}:{port}")
    return f"Authorization: Bearer {key}\r\n".encode() if key else b""


def sign(request: httpx.Request) -> None:
    """An httpx request hook: a shared client (tasks/client/control.py) serves many servers."""
    request.headers.update(headers(str(request.url)))


def snapshot() -> dict[str, str]:
    """The registry, for a worker process started with `spawn` (it imports this module afresh)."""
    with _lock:
        return dict(_keys)


def install(keys: dict[str, str]) -> None:
    with _lock:
        _keys.update(keys)
