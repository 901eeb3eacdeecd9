"""A connection's socket, read by lanebench itself: each read stamped with the time the host
received its bytes (the kernel's receive timestamp), whatever the event loop was doing then.

The event loop only says a socket is readable; `recvmsg` then returns the bytes together with
their SO_TIMESTAMPNS stamp, so neither the loop's wake-up (an idle vCPU's, on a VM: tens to
hundreds of µs) nor its work for other streams sits in a TTFT or an ITL gap. One recvmsg has ONE
stamp, the arrival of the last bytes it returned (docs/metrics.md, "Coalesced reads"): the earlier
events of such a read are marked coalesced downstream (http.EventSplitter).
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import socket
import struct
import sys
import time
from collections import deque

HIGH_WATER = 1 << 22  # bytes received but not yet read, above which the socket stops being read
_clock = time.perf_counter

_READ_SIZE = 1 << 18
# The kernel's receive timestamp of the bytes a recvmsg returns (SO_TIMESTAMPNS: a struct
# timespec, CLOCK_REALTIME, in a control message). Python's socket module does not name it; 35
# is its value in Linux's generic socket ABI (x86, arm64), the only platform lanebench runs on.
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform == "linux" else None)
_SCM_TIMESTAMPNS = _SO_TIMESTAMPNS
_ANC_SIZE = socket.CMSG_SPACE(16) if _SO_TIMESTAMPNS is not None else 0
_MAX_AGE_S = 10.0  # a kernel stamp older than this (or in the future) is a clock step: not used


def _ask_for_stamps(sock: socket.socket) -> bool:
    """Have the kernel stamp what this socket receives; False where it cannot."""
    if _SO_TIMESTAMPNS is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def _keep_receive_stamps_on() -> socket.socket | None:
    """Linux stamps received packets only while some socket asks for it, and turns that on a
    moment after the first one asks (deferred work): the first bytes on a wave's first connection
    would come unstamped. One socket asking for the whole life of the process keeps it on."""
    keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if not _ask_for_stamps(keeper):
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


class Stamped:
    """A connection's socket, each recvmsg stamped as the module says (without kernel stamps, the
    time of the read is taken instead)."""

    __slots__ = ("loop", "sock", "fd", "chunks", "buffered", "eof", "exc", "closed", "_waiter", "_paused", "_out")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop, self.sock, self.fd = loop, sock, sock.fileno()
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.buffered = 0
        self.eof = self.closed = False
        self.exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._out = bytearray()  # request bytes the socket did not take yet
        _ask_for_stamps(sock)  # without stamps, a read's own time is taken
        loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data, anc, _, _ = self.sock.recvmsg(_READ_SIZE, _ANC_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(e)
            return
        now, wall = _clock(), time.time()  # read back to back: the kernel stamp's age is taken between them
        if not data:
            self.eof = True
            self.loop.remove_reader(self.fd)
            self._wake()
            return
        self.chunks.append((_arrival(anc, now, wall) if anc else now, data))
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self._paused:
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
                return _clock(), b""
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        t, data = self.chunks.popleft()
        self.buffered -= len(data)
        if self._paused and self.buffered < HIGH_WATER // 4 and not self.closed:
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


def _literal(host: str, port: int) -> list[tuple] | None:
    """An IP address needs no resolver: asyncio's getaddrinfo runs in a thread that each wave's
    loop then waits to join at its close (between the acceptance probe's requests)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    family, address = (socket.AF_INET, (str(ip), port)) if ip.version == 4 else (socket.AF_INET6, (str(ip), port, 0, 0))
    return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address)]


async def connect(host: str, port: int) -> socket.socket:
    """A non-blocking TCP connection with Nagle off (a request goes out whole, at once)."""
    loop = asyncio.get_running_loop()
    last: OSError | None = None
    for family, kind, proto, _, address in _literal(host, port) or await loop.getaddrinfo(
            host, port, type=socket.SOCK_STREAM):
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
