"""A scripted OpenAI-compatible streaming server whose true timings are known.

It answers POST /v1/completions and /v1/chat/completions with a stream on a fixed schedule:
the first token `--ttft-ms` after the request's body arrived, then one event every `--itl-ms`
(`--zero-delay`: as fast as it can write, to find a client's raw ceiling). Every write is
stamped with time.perf_counter() (CLOCK_MONOTONIC, shared by every process on the host) just
before the bytes go to the socket; `--log` writes one JSON line per request with those stamps,
so a client's TTFT and ITL can be checked against what the server really did. A request has two
arrival stamps: `recv_bytes`, when the chunk carrying its last byte reached this process (the
protocol's data_received, as the event loop read the socket), and `recv`, after the handler's
task woke and parsed head and body (the schedule counts from `recv`).

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
import time

_MARK = re.compile(rb"#(burst|fault)=(\w+)")


class _StampedReader(asyncio.StreamReader):
    """A StreamReader that remembers when its bytes arrived: feed_data runs inside the protocol's
    data_received, as the event loop reads the socket, before the handler's task wakes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fed = 0  # bytes received so far on this connection
        self.stamps: list[tuple[int, float]] = []  # (offset just past a received chunk, its arrival)

    def feed_data(self, data: bytes) -> None:  # type: ignore[override]  # the event loop feeds bytes
        self.fed += len(data)
        self.stamps.append((self.fed, time.perf_counter()))
        super().feed_data(data)

    def arrival_of(self, offset: int) -> float:
        """When the byte just before `offset` arrived; forgets the chunks before it."""
        while len(self.stamps) > 1 and self.stamps[0][0] < offset:
            self.stamps.pop(0)
        return self.stamps[0][1]


class Fake:
    def __init__(self, args: argparse.Namespace):
        self.ttft = 0.0 if args.zero_delay else args.ttft_ms / 1000
        self.itl = 0.0 if args.zero_delay else args.itl_ms / 1000
        self.ping = args.ping_s
        self.step = args.step_ms / 1000 if args.step_ms else 0.0
        self.log = open(args.log, "a", buffering=1) if args.log else None
        self.connections = 0
        self.requests = 0

    async def handle(self, stream: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert isinstance(stream, _StampedReader)  # the protocol below reads with one
        reader = stream
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
                t_bytes = reader.arrival_of(consumed)
                if method == "GET":
                    self._json(writer, self._get(path))
                elif path.split("?")[0] in ("/v1/completions", "/v1/chat/completions"):
                    if not await self._stream(writer, path, json.loads(body or b"{}"), t_recv, t_bytes, conn):
                        return
                else:
                    self._json(writer, {"error": {"message": f"no route {path}"}}, 404)
                await writer.drain()
        finally:
            writer.close()

    def _get(self, path: str) -> dict:
        if path.startswith("/stats"):
            return {"connections": self.connections, "requests": self.requests}
        if path.startswith("/v1/models"):
            return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "lanebench"}]}
        return {"status": "ok"}

    @staticmethod
    def _json(writer: asyncio.StreamWriter, data: dict, status: int = 200) -> None:
        body = json.dumps(data).encode()
        writer.write(f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: keep-alive\r\n\r\n".encode() + body)

    async def _stream(self, writer: asyncio.StreamWriter, path: str, req: dict, t_recv: float,
                      t_bytes: float, conn: str) -> bool:
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
            data: dict[str, object] = {"id": f"cmpl-{rid}", "object": "chat.completion.chunk" if chat else "text_completion",
                                       "created": 0, "model": "fake", "choices": [{**choice, "finish_reason": "length"}]}
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        def usage(k: int) -> dict:
            return {"prompt_tokens": 8, "completion_tokens": k, "total_tokens": 8 + k}

        if fault == "empty":
            send([b"data: [DONE]\n\n"])
        elif fault == "stall":
            t_next = t_recv
            while True:
                t_next += self.ping
                await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                send([b":\n\n"])
                try:
                    await writer.drain()
                except ConnectionError:
                    return False
        else:
            t_next = t_recv + self.ttft
            sent = 0
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
                send(events)
                if fault == "close" and sent > n // 2:
                    await writer.drain()
                    return False
                if fault == "midstall" and sent > n // 2:  # tokens, then only pings: a server stuck mid-stream
                    while True:
                        await asyncio.sleep(self.ping)
                        send([b":\n\n"])
                        try:
                            await writer.drain()
                        except ConnectionError:
                            return False
                t_next += self.itl
                if len(writes) % 64 == 0 or self.itl:
                    await writer.drain()
            else:
                claimed = sent * 10 if fault == "inconsistent" else 0 if fault == "zerocount" else sent
                tail = [final(usage(claimed) if usage_each else None)]
                if opts.get("include_usage"):
                    tail.append(b"data: " + json.dumps({"id": f"cmpl-{rid}", "choices": [],
                                                        "usage": usage(claimed)}).encode() + b"\n\n")
                send([*tail, b"data: [DONE]\n\n"])
        writer.write(b"0\r\n\r\n")
        if self.log:
            self.log.write(json.dumps({"id": rid, "recv": t_recv, "recv_bytes": t_bytes, "writes": writes, "conn": conn,
                                       "burst": burst, "fault": fault, "prompt": prompt[:80].decode(errors="replace")}) + "\n")
        return True


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--zero-delay", action="store_true")
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

    def protocol() -> asyncio.StreamReaderProtocol:  # asyncio.start_server's, with the stamping reader
        return asyncio.StreamReaderProtocol(_StampedReader(limit=2 ** 16, loop=loop), fake.handle, loop=loop)

    server = await loop.create_server(protocol, args.host, args.port, backlog=2048, reuse_port=args.reuse_port or None)
    print(f"fake server listening on {args.host}:{args.port}", flush=True)
    async with server:
        await server.serve_forever()


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
