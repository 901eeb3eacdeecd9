"""A lean HTTP/1.1 client on asyncio: keep-alive connections, a counted pool, and a body reader
whose hot loop only reads and de-chunks. Each chunk of bytes comes stamped with the time the
host received it (the kernel's receive timestamp, tasks/client/stamped.py), not when the event
loop woke, nor when the reading task got around to it.

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

from tasks.client.stamped import Stamped, connect

_CRLF = b"\r\n"
CONNECT_TIMEOUT_S = 10.0


class HTTPError(Exception):
    """The server broke HTTP framing (not an HTTP error status: those are responses)."""


@dataclass
class Connection:
    proto: Stamped
    connect_s: float  # how long the TCP connect took

    @property
    def gone(self) -> bool:
        """The server closed it (or it broke), or we did."""
        p = self.proto
        return (p.eof and not p.chunks) or p.closed


@dataclass
class Response:
    status: int
    reused: bool  # the connection was kept alive for the next request
    pieces: list[tuple[float, bytes]] = field(default_factory=list)  # (perf_counter at arrival, body bytes)


class Pool:
    """Keep-alive connections to one host:port. At most `size` are open at once: a caller that
    finds none idle opens one; a connection the server closed is replaced (and counted)."""

    def __init__(self, host: str, port: int, size: int):
        self.host, self.port, self.size = host, port, size
        self.opened = 0
        self.server_closed = 0  # connections the server ended after a response (its choice, not ours)
        self._idle: list[Connection] = []

    async def acquire(self, fresh: bool = False) -> tuple[Connection, bool]:
        """(connection, reused). New connections are opened here, timed apart from the request;
        `fresh` skips the idle ones (a retry after a kept-alive connection turned out closed)."""
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.gone:
                return conn, True
            self.server_closed += 1
            conn.proto.close()
        t0 = time.perf_counter()
        # asyncio.timeout, not wait_for: wait_for wraps the connect in a task of its own, and at
        # C=64 against llama-server (a new connection per request) 64 of them start in one turn
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            sock = await connect(self.host, self.port)
        self.opened += 1
        return Connection(Stamped(asyncio.get_running_loop(), sock), connect_s=time.perf_counter() - t0), False

    def release(self, conn: Connection, keep: bool) -> None:
        if keep and len(self._idle) < self.size:
            self._idle.append(conn)
        else:
            conn.proto.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().proto.close()


def request_bytes(host: str, port: int, path: str, body: bytes, extra: bytes = b"") -> bytes:
    """One POST; `extra`: more head lines, each ending in CRLF (the API key's header)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: keep-alive\r\n")
    return head.encode() + extra + b"\r\n" + body


async def _head(proto: Stamped) -> tuple[int, dict[str, str]]:
    buf = b""
    while (i := buf.find(b"\r\n\r\n")) < 0:
        t, data = await proto.read()
        if not data:
            raise HTTPError("connection closed before the response head" if not buf
                            else f"truncated response head: {buf[:200]!r}")
        buf += data
    if len(buf) > i + 4:  # the body's first bytes came with the head: they keep that chunk's stamp
        proto.unread(t, buf[i + 4:])
    lines = buf[:i].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HTTPError(f"not an HTTP/1.x status line: {lines[0][:200]!r}")
    return int(parts[1]), {k.strip().lower(): v.strip() for k, sep, v in (line.partition(":") for line in lines[1:]) if sep}


async def read_response(conn: Connection, sink: Callable[[float, bytes], None] | None = None) -> Response:
    """Read one response to its end, each body piece stamped (`Stamped`); a 2xx body's pieces go to
    `sink` as they come (their parsing then overlaps the wait for the next chunk)."""
    proto = conn.proto
    read = proto.read
    status, headers = await _head(proto)
    keep = headers.get("connection", "").lower() != "close"
    resp = Response(status=status, reused=keep)
    store, sink = resp.pieces.append, sink if status < 400 else None

    def piece(t: float, data: bytes) -> None:
        store((t, data))
        if sink is not None:
            sink(t, data)

    if "chunked" in headers.get("transfer-encoding", "").lower():
        buf, pos = b"", 0  # pos: where the unread part of buf starts (no re-slicing per frame)
        need = -1  # bytes of chunk data still expected; -1: a size line comes next
        while True:
            t, data = await read()
            if not data:
                raise HTTPError("connection closed inside a chunked body")
            buf = buf[pos:] + data if pos < len(buf) else data
            pos, end = 0, len(buf)
            out: list[bytes] = []
            while True:
                if need < 0:
                    i = buf.find(_CRLF, pos)
                    if i < 0:
                        break
                    try:
                        need = int(buf[pos:i].split(b";", 1)[0], 16)
                    except ValueError:
                        raise HTTPError(f"bad chunk size line {buf[pos:i][:80]!r}") from None
                    pos = i + 2
                    if need == 0:  # last chunk; the trailer ends with an empty line
                        if out:
                            piece(t, b"".join(out))
                        buf = buf[pos:]
                        while not (buf.startswith(_CRLF) or b"\r\n\r\n" in buf):
                            _, more = await read()
                            if not more:
                                resp.reused = False
                                break
                            buf += more
                        return resp
                if end - pos < need + 2:
                    if need and end > pos:
                        take = min(need, end - pos)
                        out.append(buf[pos:pos + take])
                        pos, need = pos + take, need - take
                    break
                out.append(buf[pos:pos + need])
                pos, need = pos + need + 2, -1
            if out:
                piece(t, b"".join(out))
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            t, data = await read()
            if not data:
                raise HTTPError("connection closed inside a body")
            if len(data) > left:  # bytes past this body stay on the connection
                proto.unread(t, data[left:])
                data = data[:left]
            piece(t, data)
            left -= len(data)
    else:  # a body delimited by the connection's close
        resp.reused = False
        while True:
            t, data = await read()
            if not data:
                break
            piece(t, data)
    return resp


class EventSplitter:
    """Server-sent events (blank-line separated) as the chunks arrive, each event with the stamp
    of the chunk that carried its first byte, and whether that stamp is its own: an event whose
    read also carried bytes of a later event has that read's stamp, an upper bound (`shared`;
    docs/metrics.md, "Coalesced reads")."""

    def __init__(self) -> None:
        self.buf, self.t_first = b"", 0.0

    def feed(self, t: float, data: bytes) -> list[tuple[float, bytes, bool]]:
        if not self.buf:
            self.t_first = t
        # One split a read (a zero-delay stream brings hundreds of events in one read: slicing
        # the rest off event by event, and stripping it to ask what follows, was quadratic).
        if b"\r" in data:  # (a search, not a copy, for the servers that write bare newlines)
            data = data.replace(b"\r\n", b"\n")
        parts = (self.buf + data).split(b"\n\n")
        self.buf = parts.pop()
        later = bool(self.buf.strip())  # going backwards: does anything non-blank follow part k?
        events = []
        for k in range(len(parts) - 1, -1, -1):
            stamp = self.t_first if k == 0 else t  # what followed the first event began in this chunk
            if parts[k].strip():
                events.append((stamp, parts[k], stamp == t and later))
                later = True
        if parts:
            self.t_first = t
        events.reverse()
        return events

    def close(self) -> list[tuple[float, bytes, bool]]:
        """An event the stream ended without its blank line."""
        raw, self.buf = self.buf, b""
        return [(self.t_first, raw, False)] if raw.strip() else []
