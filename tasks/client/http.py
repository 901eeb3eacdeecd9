"""A lean HTTP/1.1 client on asyncio: keep-alive connections, a counted pool, and a body reader
whose hot loop only reads, timestamps and de-chunks. Each chunk of bytes is stamped with the
time the host received it: the kernel's receive timestamp (SO_TIMESTAMPNS), returned with the
bytes by the recvmsg that reads them; not when the event loop woke, nor when the reading task
got around to them.

Chosen by measurement (docs/benchmarks.md, "The load generator"): httpx's pool and line
iterator cost more CPU per streamed event than the whole measurement may, and a stream left
before its chunked body ended cost a new TCP connection per request. Here every body is read
to its end, so a connection serves the next request; the pool counts every connection it
opens, so a wave can show that connections opened == concurrency.
"""

from __future__ import annotations

import asyncio
import atexit
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

_CRLF = b"\r\n"
_HIGH_WATER = 1 << 22  # bytes received but not yet read, above which the socket stops being read
_now = time.perf_counter


class HTTPError(Exception):
    """The server broke HTTP framing (not an HTTP error status: those are responses)."""


_READ_SIZE = 1 << 18
# The kernel's receive timestamp of the bytes a recvmsg returns (SO_TIMESTAMPNS: a struct
# timespec, CLOCK_REALTIME, in a control message). Python's socket module does not name it; 35
# is its value in Linux's generic socket ABI (x86, arm64), the only platform lanebench runs on.
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform == "linux" else None)
_SCM_TIMESTAMPNS = _SO_TIMESTAMPNS
_ANC_SIZE = socket.CMSG_SPACE(16) if _SO_TIMESTAMPNS is not None else 0
_MAX_AGE_S = 10.0  # a kernel stamp older than this (or in the future) is a clock step: not used


def _keep_receive_stamps_on() -> socket.socket | None:
    """Linux stamps received packets only while some socket asks for it, and turns that on a
    moment after the first one asks (deferred work): the first bytes on a wave's first connection
    would come unstamped. One socket asking for the whole life of the process keeps it on."""
    if _SO_TIMESTAMPNS is None:
        return None
    keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        keeper.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        keeper.close()
        return None
    atexit.register(keeper.close)
    return keeper


_STAMPS_ON = _keep_receive_stamps_on()


def _arrival(anc: list[tuple[int, int, bytes]], now: float, wall: float) -> float:
    """When the host received these bytes, on the perf_counter clock: the kernel's stamp, moved
    onto perf_counter by its age (`wall`, the wall clock read right after `now`, minus the
    stamp); `now` without one."""
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == _SCM_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            age = wall - (sec + nsec * 1e-9)
            if 0.0 <= age < _MAX_AGE_S:
                return now - age
    return now


class _Stamped:
    """A connection's socket, read by this class itself (the event loop only says it is
    readable): each recvmsg returns the bytes with the kernel's receive timestamp, the moment the
    host got them, so neither the event loop's wake-up nor the work it was doing for other
    streams is in the stamp. Without kernel stamps, the time of the read is taken instead."""

    __slots__ = ("loop", "sock", "fd", "chunks", "buffered", "eof", "exc", "closed", "kernel_stamps",
                 "_waiter", "_paused", "_out")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop, self.sock, self.fd = loop, sock, sock.fileno()
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.buffered = 0
        self.eof = self.closed = False
        self.exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._out = bytearray()  # request bytes the socket did not take yet
        self.kernel_stamps = False
        if _SO_TIMESTAMPNS is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
                self.kernel_stamps = True
            except OSError:
                pass
        loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data, anc, _, _ = self.sock.recvmsg(_READ_SIZE, _ANC_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(e)
            return
        now, wall = _now(), time.time()  # read back to back: the kernel stamp's age is taken between them
        if not data:
            self.eof = True
            self.loop.remove_reader(self.fd)
            self._wake()
            return
        self.chunks.append((_arrival(anc, now, wall) if anc else now, data))
        self.buffered += len(data)
        if self.buffered > _HIGH_WATER and not self._paused:
            self._paused = True  # a reader that fell far behind: let TCP push back
            self.loop.remove_reader(self.fd)
        self._wake()

    def write(self, data: bytes) -> None:
        """Send now; what the socket does not take goes out as it drains (a long prompt)."""
        if self.closed:
            raise ConnectionError("write on a closed connection")
        if not self._out:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self._lost(e)
                raise ConnectionError(f"connection lost: {e}") from e
            if sent == len(data):
                return
            self.loop.add_writer(self.fd, self._writable)
            data = data[sent:]
        self._out += data

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(e)
            return
        del self._out[:sent]
        if not self._out:
            self.loop.remove_writer(self.fd)

    def _lost(self, exc: BaseException) -> None:
        self.eof, self.exc = True, exc
        self.close()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def read(self) -> tuple[float, bytes]:
        """The next received chunk with its arrival stamp; b"" once the peer is gone."""
        while not self.chunks:
            if self.eof:
                if self.exc is not None:
                    raise ConnectionError(f"connection lost: {self.exc}") from self.exc
                return _now(), b""
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        t, data = self.chunks.popleft()
        self.buffered -= len(data)
        if self._paused and self.buffered < _HIGH_WATER // 4 and not self.closed:
            self._paused = False
            self.loop.add_reader(self.fd, self._readable)
        return t, data

    def unread(self, t: float, data: bytes) -> None:
        """Put bytes back at the front, with the stamp of the chunk they came in."""
        self.chunks.appendleft((t, data))
        self.buffered += len(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = self.eof = True
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.sock.close()
        self._wake()  # a read still waiting ends with the bytes it has, or b""


async def _connect(host: str, port: int) -> socket.socket:
    """A non-blocking TCP connection with Nagle off (a request goes out whole, at once)."""
    loop = asyncio.get_running_loop()
    last: OSError | None = None
    for family, kind, proto, _, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as e:
            sock.close()
            last = e
        except BaseException:
            sock.close()
            raise
    raise last or OSError(f"no address for {host}:{port}")


@dataclass
class Connection:
    proto: _Stamped
    connect_s: float  # how long the TCP connect took
    served: int = 0  # requests this connection has carried

    def write(self, data: bytes) -> None:
        self.proto.write(data)

    @property
    def gone(self) -> bool:
        """The server closed it (or it broke), or we did."""
        p = self.proto
        return (p.eof and not p.chunks) or p.closed

    def close(self) -> None:
        self.proto.close()


@dataclass
class Response:
    status: int
    reused: bool  # the connection was kept alive for the next request
    pieces: list[tuple[float, bytes]] = field(default_factory=list)  # (perf_counter at arrival, body bytes)


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
            if not conn.gone:
                return conn, True
            self.server_closed += 1
            conn.close()
        t0 = time.perf_counter()
        sock = await asyncio.wait_for(_connect(self.host, self.port), self.connect_timeout)
        self.opened += 1
        return Connection(_Stamped(asyncio.get_running_loop(), sock), connect_s=time.perf_counter() - t0), False

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


async def _head(proto: _Stamped) -> tuple[int, dict[str, str]]:
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
    """Read one response to its end. Each piece of the body carries the time the host received
    its bytes (`_Stamped`), whenever this task got to them; a 2xx body's pieces go to `sink` as
    they come (its parsing then overlaps the wait for the next chunk)."""
    proto = conn.proto
    read = proto.read
    status, headers = await _head(proto)
    keep = headers.get("connection", "").lower() != "close"
    resp = Response(status=status, reused=keep)
    pieces = resp.pieces = _Pieces(sink if status < 400 else None)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        buf, pos = b"", 0  # pos: where the unread part of buf starts (no re-slicing per frame)
        need = -1  # bytes of chunk data still expected; -1: a size line comes next
        while True:
            t, data = await read()
            if not data:
                raise HTTPError("connection closed inside a chunked body")
            buf = buf[pos:] + data if pos < len(buf) else data
            pos, end = 0, len(buf)
            out = []
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
                            pieces.append((t, b"".join(out)))
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
                pieces.append((t, b"".join(out)))
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            t, data = await read()
            if not data:
                raise HTTPError("connection closed inside a body")
            if len(data) > left:  # bytes past this body stay on the connection
                proto.unread(t, data[left:])
                data = data[:left]
            pieces.append((t, data))
            left -= len(data)
    else:  # a body delimited by the connection's close
        resp.reused = False
        while True:
            t, data = await read()
            if not data:
                break
            pieces.append((t, data))
    return resp


class EventSplitter:
    """Server-sent events (blank-line separated) as the chunks arrive, each event with the stamp
    of the chunk that carried its first byte."""

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
            self.t_first = t  # what is left began in this chunk
        return events

    def close(self) -> list[tuple[float, bytes]]:
        """An event the stream ended without its blank line."""
        raw, self.buf = self.buf, b""
        return [(self.t_first, raw)] if raw.strip() else []
