"""A lean HTTP/1.1 client over asyncio streams: keep-alive connections, a counted pool, and a
body reader whose hot loop only reads, timestamps and de-chunks.

Chosen by measurement (docs/benchmarks.md, "The load generator"): httpx's pool and line
iterator cost more CPU per streamed event than the whole measurement may, and a stream left
before its chunked body ended cost a new TCP connection per request. Here every body is read
to its end, so a connection serves the next request; the pool counts every connection it
opens, so a wave can show that connections opened == concurrency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_CRLF = b"\r\n"


class HTTPError(Exception):
    """The server broke HTTP framing (not an HTTP error status: those are responses)."""


@dataclass
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    connect_s: float  # how long the TCP connect took
    served: int = 0  # requests this connection has carried

    def close(self) -> None:
        self.writer.close()


@dataclass
class Response:
    status: int
    reused: bool  # the connection was kept alive for the next request
    pieces: list[tuple[float, bytes]] = field(default_factory=list)  # (perf_counter at read, body bytes)


class Pool:
    """Keep-alive connections to one host:port. At most `size` are open at once: a caller that
    finds none idle opens one; a connection the server closed is replaced (and counted)."""

    def __init__(self, host: str, port: int, size: int, connect_timeout: float = 10.0):
        self.host, self.port, self.size = host, port, size
        self.connect_timeout = connect_timeout
        self.opened = 0
        self.server_closed = 0  # connections the server ended after a response (its choice, not ours)
        self._idle: list[Connection] = []

    async def acquire(self, fresh: bool = False) -> tuple[Connection, bool]:
        """(connection, reused). New connections are opened here, timed apart from the request;
        `fresh` skips the idle ones (a retry after a kept-alive connection turned out closed)."""
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not (conn.reader.at_eof() or conn.writer.is_closing()):
                return conn, True
            self.server_closed += 1
            conn.close()
        t0 = time.perf_counter()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, limit=1 << 20), self.connect_timeout)
        self.opened += 1
        return Connection(reader, writer, connect_s=time.perf_counter() - t0), False

    def release(self, conn: Connection, keep: bool) -> None:
        if keep and len(self._idle) < self.size:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


def request_bytes(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n")
    return head.encode() + body


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        raise HTTPError("connection closed before the response head" if not e.partial
                        else f"truncated response head: {e.partial[:200]!r}") from None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HTTPError(f"not an HTTP/1.x status line: {lines[0][:200]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


class _Pieces(list):
    """The body's pieces; each one is also handed to `sink` (after it was stamped)."""

    def __init__(self, sink: Callable[[float, bytes], None] | None):
        super().__init__()
        self.sink = sink

    def append(self, item: tuple[float, bytes]) -> None:
        super().append(item)
        if self.sink is not None:
            self.sink(*item)


async def read_response(conn: Connection, sink: Callable[[float, bytes], None] | None = None) -> Response:
    """Read one response to its end. Each read is stamped with perf_counter() the moment it
    returns, before anything looks at its bytes; the pieces keep those stamps, and a 2xx body's
    pieces go to `sink` as they come (its parsing then overlaps the wait for the next read)."""
    reader = conn.reader
    status, headers = await _head(reader)
    keep = headers.get("connection", "").lower() != "close"
    resp = Response(status=status, reused=keep)
    pieces = resp.pieces = _Pieces(sink if status < 400 else None)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        buf = b""
        need = -1  # bytes of chunk data still expected; -1: a size line comes next
        while True:
            data = await reader.read(65536)
            t = time.perf_counter()
            if not data:
                raise HTTPError("connection closed inside a chunked body")
            buf += data
            out = []
            while True:
                if need < 0:
                    i = buf.find(_CRLF)
                    if i < 0:
                        break
                    try:
                        need = int(buf[:i].split(b";", 1)[0], 16)
                    except ValueError:
                        raise HTTPError(f"bad chunk size line {buf[:i][:80]!r}") from None
                    buf = buf[i + 2:]
                    if need == 0:  # last chunk; the trailer ends with an empty line
                        if out:
                            pieces.append((t, b"".join(out)))
                        while not (buf.startswith(_CRLF) or b"\r\n\r\n" in buf):
                            more = await reader.read(65536)
                            if not more:
                                resp.reused = False
                                break
                            buf += more
                        return resp
                if len(buf) < need + 2:
                    if need and buf:
                        take = min(need, len(buf))
                        out.append(buf[:take])
                        buf, need = buf[take:], need - take
                    break
                out.append(buf[:need])
                buf, need = buf[need + 2:], -1
            if out:
                pieces.append((t, b"".join(out)))
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            t = time.perf_counter()
            if not data:
                raise HTTPError("connection closed inside a body")
            pieces.append((t, data))
            left -= len(data)
    else:  # a body delimited by the connection's close
        resp.reused = False
        while data := await reader.read(65536):
            pieces.append((time.perf_counter(), data))
    return resp


class EventSplitter:
    """Server-sent events (blank-line separated) as the reads arrive, each event with the stamp
    of the read that carried its first byte."""

    def __init__(self) -> None:
        self.buf, self.t_first = b"", 0.0

    def feed(self, t: float, data: bytes) -> list[tuple[float, bytes]]:
        if not self.buf:
            self.t_first = t
        self.buf += data.replace(b"\r\n", b"\n")
        events = []
        while (i := self.buf.find(b"\n\n")) >= 0:
            raw, self.buf = self.buf[:i], self.buf[i + 2:]
            if raw.strip():
                events.append((self.t_first, raw))
            self.t_first = t  # what is left began in this read
        return events

    def close(self) -> list[tuple[float, bytes]]:
        """An event the stream ended without its blank line."""
        raw, self.buf = self.buf, b""
        return [(self.t_first, raw)] if raw.strip() else []
