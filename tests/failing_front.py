"""A real HTTP front for a real llama-server that starts failing completions with HTTP 500 on cue
(a fault test's server that "answers 5xx": an overloaded gateway, a crashed worker behind a router).

Used as a lane's `binary`: argv is the front's own three arguments, then llama-server's argv as
lanebench built it. The front takes the lane's `--port`, starts llama-server (in the front's process
group, which lanebench stops as one) on a free port of its own, and relays every request
byte for byte, streams included. Once `fail_file` exists, each completion request is answered
HTTP 500 in llama-server's own error shape instead of being relayed, and one line is appended
to `failed_log`; health, metrics and slots still pass through, so the server looks alive.
When llama-server exits the front exits with its code.

argv: llama-server path, fail_file, failed_log, then llama-server's arguments.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import os
from pathlib import Path

real, fail_file, failed_log = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
argv = sys.argv[4:]
COMPLETIONS = ("/v1/completions", "/completion", "/completions", "/v1/chat/completions")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


i = argv.index("--port")
port, inner = int(argv[i + 1]), _free_port()
argv[i + 1] = str(inner)
server = subprocess.Popen([real, *argv])


def _follow() -> None:
    code = server.wait()
    os._exit(code if code >= 0 else 128 - code)


threading.Thread(target=_follow, daemon=True).start()
ERROR = json.dumps({"error": {"code": 500, "message": "the front's upstream failed (injected)",
                              "type": "server_error"}}).encode()


async def _head(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request's head and body (Content-Length bodies only: what lanebench sends)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return head, body


async def _relay(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
    """Relay one request on a new upstream connection (`Connection: close`), its answer as it comes."""
    lines = [ln for ln in head.rstrip(b"\r\n").split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    try:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", inner)
    except OSError:
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return
    up_w.write(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n" + body)
    while data := await up_r.read(65536):
        writer.write(data)
        await writer.drain()
    up_w.close()


async def _client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        got = await _head(reader)
        if got is None:
            return
        head, body = got
        method, path = head.split(b" ", 2)[:2]
        if method == b"POST" and path.decode().split("?")[0] in COMPLETIONS and fail_file.exists():
            with failed_log.open("a") as f:
                f.write(f"{path.decode()}\n")
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(ERROR)).encode() + b"\r\nConnection: close\r\n\r\n" + ERROR)
        else:
            await _relay(head, body, writer)
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main() -> None:
    front = await asyncio.start_server(_client, "127.0.0.1", port)
    async with front:
        await front.serve_forever()


asyncio.run(main())
