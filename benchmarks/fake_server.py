"""A scripted OpenAI-compatible streaming server whose true timings are known.

It answers POST /v1/completions and /v1/chat/completions with a stream on a fixed schedule:
the first token `--ttft-ms` after the request's body arrived, then one event every `--itl-ms`
(`--zero-delay`: as fast as it can write, to find a client's raw ceiling; `--events-per-write N`:
N token events a write, so the server's own syscalls do not cap a fast client). Every write is
stamped with time.perf_counter() (CLOCK_MONOTONIC, shared by every process on the host) just
before the bytes go to the socket; `--log` writes one JSON line per request with those stamps,
so a client's TTFT and ITL can be checked against what the server really did. A request has three
arrival stamps: `recv_bytes`, when its last byte reached this host (the kernel's SO_TIMESTAMPNS
stamp of the read that carried it, moved onto perf_counter; the read's own time where the kernel
gives none), `recv_read`, when this process read those bytes, and `recv`, after the handler's task
woke and parsed head and body (the schedule counts from `recv`). The server reads and writes its
sockets itself (the event loop only says one is ready), so each read has its kernel stamp.

Markers in the prompt script one request:
  #burst=N        N tokens in one event, then the gap (speculative decoding's bursts: vLLM streams
                  a step's accepted tokens as one event's token_ids)
  #fault=malformed|error|errorclose|empty|inconsistent|stall|close|midstall|zerocount
      malformed: a broken JSON event mid-stream; error: llama-server's mid-stream
      `data: {"error": {...}}`; empty: only `data: [DONE]`; inconsistent: final usage claims 10x
      the tokens sent; errorclose: the error event, then the connection drops; stall: pings (`:`)
      every --ping-s and never finishes; close: the connection drops mid-stream; midstall: half
      the tokens, then only pings; zerocount: the final usage claims 0 tokens.
GET /stats returns {"connections": accepted so far, "requests": served so far}.

`--reuse-port`: several fake servers share one port (SO_REUSEPORT: the kernel spreads the
connections over them), one core each, so one client's many worker processes meet a server
that is not the bottleneck. Each logs the connection a request came on as "pid:n".

`--step-ms S`: the server steps like a batching engine (llama-server, vLLM): every event is
written on a grid of S ms shared by all streams, so the events of all running streams leave at the
same tick and reach a client as one burst (what a client meets at C=64 on a GPU).

`--busy-poll`: the loop polls its sockets with a zero timeout instead of sleeping on them, so
its core never idles: a request's arrival is stamped without waiting for a halted (virtual) CPU
to wake, and that wake-up is then not counted against the client under test.

Run: python benchmarks/fake_server.py --port 18500 --ttft-ms 20 --itl-ms 5 [--cpu 0] [--log f]
Only the standard library: a peer's venv or a test can start it with any Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import selectors
import socket
import struct
import time

_MARK = re.compile(rb"#(burst|fault)=(\w+)")


_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's generic ABI value (x86, arm64)
_ANC = socket.CMSG_SPACE(16)


class _StampedReader(asyncio.StreamReader):
    """A StreamReader that remembers when its bytes arrived: (kernel stamp, read time) per read."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fed = 0  # bytes received so far on this connection
        self.stamps: list[tuple[int, float, float]] = []  # (offset just past a read, kernel stamp, read time)

    def feed_stamped(self, data: bytes, kernel: float, read: float) -> None:
        self.fed += len(data)
        self.stamps.append((self.fed, kernel, read))
        self.feed_data(data)

    def arrival_of(self, offset: int) -> tuple[float, float]:
        """When the byte just before `offset` arrived (kernel, read); forgets the reads before it."""
        while len(self.stamps) > 1 and self.stamps[0][0] < offset:
            self.stamps.pop(0)
        return self.stamps[0][1:]


class _Connection:
    """One accepted socket, read with recvmsg (the event loop's transport gives no stamp) and written
    straight to it: only what the handler needs (write, sent at once, the rest held; drain; close)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop, self.sock, self.fd = loop, sock, sock.fileno()
        self.reader = _StampedReader(limit=2 ** 16, loop=loop)
        self.held = bytearray()
        self.error: OSError | None = None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data, anc, _, _ = self.sock.recvmsg(1 << 16, _ANC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, anc = b"", []
        read = time.perf_counter()
        if not data:
            self.loop.remove_reader(self.fd)
            self.reader.feed_eof()
            return
        kernel = read
        for level, kind, stamp in anc:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(stamp) >= 16:
                sec, nsec = struct.unpack("qq", stamp[:16])
                age = time.time() - (sec + nsec * 1e-9)
                kernel = read - age if 0.0 <= age < 10.0 else read
        self.reader.feed_stamped(data, kernel, read)

    def write(self, data: bytes) -> None:
        if self.error is None and not self.held:
            try:
                data = data[self.sock.send(data):]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                self.error = e
        if self.error is None:
            self.held += data

    async def drain(self) -> None:
        if self.held and self.error is None:
            data, self.held = bytes(self.held), bytearray()
            try:
                await self.loop.sock_sendall(self.sock, data)
            except OSError as e:
                self.error = e
        if self.error is not None:
            raise ConnectionResetError(str(self.error))

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        self.sock.close()


class Fake:
    def __init__(self, args: argparse.Namespace):
        self.ttft = 0.0 if args.zero_delay else args.ttft_ms / 1000
        self.itl = 0.0 if args.zero_delay else args.itl_ms / 1000
        self.ping = args.ping_s
        self.step = args.step_ms / 1000 if args.step_ms else 0.0
        self.per_write = args.events_per_write if args.zero_delay else 1
        self.log = open(args.log, "a", buffering=1) if args.log else None
        self.connections = 0
        self.requests = 0
        self._tail_cache: dict[tuple[bool, bool], list[bytes]] = {}

    async def handle(self, writer: _Connection) -> None:
        reader = writer.reader
        self.connections += 1
        conn = f"{os.getpid()}:{self.connections}"
        consumed = 0  # bytes of this connection's requests read so far
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                t_recv = time.perf_counter()
                consumed += len(head) + len(body)
                t_bytes, t_read = reader.arrival_of(consumed)
                if method == "GET":
                    self._json(writer, self._get(path))
                elif path.split("?")[0] in ("/v1/completions", "/v1/chat/completions"):
                    if not await self._stream(writer, path, json.loads(body or b"{}"), t_recv, (t_bytes, t_read), conn):
                        return
                else:
                    self._json(writer, {"error": {"message": f"no route {path}"}}, 404)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):  # the client went mid-request or mid-stream
            return
        finally:
            writer.close()

    def _tails(self, chat: bool, usage_each: bool, n: int) -> list[bytes]:
        """What follows the head in token events 1..n (the same for every request: ids count from 1)."""
        tails = self._tail_cache.setdefault((chat, usage_each), [])
        for i in range(len(tails) + 1, n + 1):
            ids = b"" if chat else b"%d],\"finish_reason\":null}]" % i
            more = b',"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}' % (i, 8 + i) if usage_each else b""
            tails.append(ids + more + b"}\n\n")
        return tails[:n]

    def _get(self, path: str) -> dict:
        if path.startswith("/stats"):
            return {"connections": self.connections, "requests": self.requests}
        if path.startswith("/v1/models"):
            return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "lanebench"}]}
        return {"status": "ok"}

    @staticmethod
    def _json(writer: _Connection, data: dict, status: int = 200) -> None:
        body = json.dumps(data).encode()
        writer.write(f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: keep-alive\r\n\r\n".encode() + body)

    async def _stream(self, writer: _Connection, path: str, req: dict, t_recv: float,
                      t_arrival: tuple[float, float], conn: str) -> bool:
        self.requests += 1
        rid = self.requests
        chat = "chat" in path
        prompt = json.dumps(req.get("messages") if chat else req.get("prompt", "")).encode()
        marks = dict((k.decode(), v.decode()) for k, v in _MARK.findall(prompt))
        burst = int(marks.get("burst", "1"))
        fault = marks.get("fault")
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        opts = req.get("stream_options") or {}
        usage_each = bool(opts.get("continuous_usage_stats"))
        writes: list[float] = []
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: keep-alive\r\n\r\n")

        def send(events: list[bytes]) -> None:
            data = b"".join(events)
            writes.append(time.perf_counter())
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        # The token events are the hot path of --zero-delay: render them by template, not json.dumps.
        if chat:
            head = (b'data: {"id":"cmpl-%d","object":"chat.completion.chunk","created":0,"model":"fake",'
                    b'"choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]' % rid)
        else:
            head = (b'data: {"id":"cmpl-%d","object":"text_completion","created":0,"model":"fake",'
                    b'"choices":[{"index":0,"text":" tok","token_ids":[' % rid)

        def token(i: int, k: int = 1) -> bytes:
            """The event carrying tokens i-k+1 .. i."""
            ids = b",".join(b"%d" % j for j in range(i - k + 1, i + 1))
            mid = head if chat else head + b"%s],\"finish_reason\":null}]" % ids
            if usage_each:
                return mid + b',"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (i, 8 + i)
            return mid + b"}\n\n"

        def final(usage: dict | None) -> bytes:
            """The event that ends the stream (finish_reason "length"), with the usage if asked for."""
            choice = {"index": 0, "delta": {}} if chat else {"index": 0, "text": "", "token_ids": []}
            data = {"id": f"cmpl-{rid}", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                    "model": "fake", "choices": [{**choice, "finish_reason": "length"}], **({} if usage is None else {"usage": usage})}
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        def usage(k: int) -> dict:
            return {"prompt_tokens": 8, "completion_tokens": k, "total_tokens": 8 + k}

        def finish(claimed: int) -> None:
            """The final event, the usage event if asked for, and [DONE], in one write."""
            tail = [final(usage(claimed) if usage_each else None)]
            if opts.get("include_usage"):
                tail.append(b"data: " + json.dumps({"id": f"cmpl-{rid}", "choices": [],
                                                    "usage": usage(claimed)}).encode() + b"\n\n")
            send([*tail, b"data: [DONE]\n\n"])

        async def pings(t_next: float) -> None:
            """Only pings (`:`) every --ping-s from `t_next` on, until the client goes (ConnectionError)."""
            while True:
                t_next += self.ping
                await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                send([b":\n\n"])
                await writer.drain()

        if fault == "empty":
            send([b"data: [DONE]\n\n"])
        elif not (self.ttft or self.itl or self.step or fault) and burst == 1 and self.per_write > 1:
            # --zero-delay's raw ceiling: each write is the head joined over cached tails (one C-level
            # join, no Python a token), so the server's core stops being the limit of a fast client.
            tails = self._tails(chat, usage_each, n)
            for i in range(0, n, self.per_write):
                send([head, head.join(tails[i:i + self.per_write])])
                if len(writes) % 64 == 0:
                    await writer.drain()
            finish(n)
        elif fault == "stall":
            await pings(t_recv)
        else:
            t_next = t_recv + self.ttft
            sent = 0
            pending: list[bytes] = []  # token events held for one write (--events-per-write)
            while sent < n:
                if self.step:  # the next tick of the shared grid at or after t_next
                    t_next = math.ceil(t_next / self.step - 1e-6) * self.step
                if self.ttft or self.itl:
                    await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                k = min(burst, n - sent)
                sent += k
                events = [token(sent, k)]
                if fault == "malformed" and sent > n // 2:
                    events.append(b'data: {"choices": [{"text": "tok"\n\n')
                    fault = "done"
                if fault in ("error", "errorclose") and sent > n // 2:
                    events.append(b'data: {"error":{"code":500,"message":"slot 0 failed: out of memory",'
                                  b'"type":"server_error"}}\n\n')
                    send(events)
                    if fault == "errorclose":
                        await writer.drain()
                        return False
                    break
                if self.per_write > 1 and not fault:
                    pending += events
                    if len(pending) >= self.per_write or sent >= n:
                        send(pending)
                        pending = []
                else:
                    send(events)
                if fault == "close" and sent > n // 2:
                    await writer.drain()
                    return False
                if fault == "midstall" and sent > n // 2:  # tokens, then only pings: a server stuck mid-stream
                    await pings(time.perf_counter())
                t_next += self.itl
                if len(writes) % 64 == 0 or self.itl:
                    await writer.drain()
            else:
                finish(sent * 10 if fault == "inconsistent" else 0 if fault == "zerocount" else sent)
        if self.log:  # before the body's last chunk: a client that has its response may read the log at once
            self.log.write(json.dumps({"id": rid, "recv": t_recv, "recv_bytes": t_arrival[0], "recv_read": t_arrival[1],
                                       "writes": writes, "conn": conn,
                                       "burst": burst, "fault": fault, "prompt": prompt[:80].decode(errors="replace")}) + "\n")
        writer.write(b"0\r\n\r\n")
        return True


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--zero-delay", action="store_true")
    p.add_argument("--events-per-write", type=int, default=1, help="--zero-delay: token events a write")
    p.add_argument("--step-ms", type=float, default=0.0, help="write every event on one shared grid (a batch step)")
    p.add_argument("--ping-s", type=float, default=30.0)
    p.add_argument("--cpu", type=int, default=None, help="pin the server to this core")
    p.add_argument("--log", default=None)
    p.add_argument("--busy-poll", action="store_true", help="poll the sockets instead of sleeping on them")
    p.add_argument("--reuse-port", action="store_true", help="share the port with other fake servers (SO_REUSEPORT)")
    return p.parse_args()


async def serve(args: argparse.Namespace) -> None:
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    fake = Fake(args)
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if args.reuse_port:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind((args.host, args.port))
    listener.listen(2048)
    listener.setblocking(False)
    print(f"fake server listening on {args.host}:{args.port}", flush=True)
    tasks: set[asyncio.Task] = set()
    while True:
        sock, _ = await loop.sock_accept(listener)
        task = loop.create_task(fake.handle(_Connection(loop, sock)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class _BusyPoll(selectors.EpollSelector):
    """epoll asked with a zero timeout until something is ready or the loop's timeout passes."""

    def select(self, timeout: float | None = None) -> list:
        end = None if timeout is None else time.perf_counter() + timeout
        while not (ready := super().select(0)) and (end is None or time.perf_counter() < end):
            pass
        return ready


def main() -> None:
    args = options()
    loop = (lambda: asyncio.SelectorEventLoop(_BusyPoll())) if args.busy_poll else None
    with asyncio.Runner(loop_factory=loop) as runner:
        runner.run(serve(args))


if __name__ == "__main__":
    main()
