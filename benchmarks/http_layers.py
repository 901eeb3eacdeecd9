"""Which HTTP layer the load generator stands on, by measurement: httpx, aiohttp and the lean
asyncio reader (tasks/client/http.py) each stream the same zero-delay responses from the fake
server at the same concurrency, the same work per read (docs/benchmarks.md, "Choosing the HTTP
layer"). Prints streamed events/s, the client's CPU per second and the connections opened.

Runs under any Python that has httpx and aiohttp (aiperf's throwaway venv has both; `--layers`
picks fewer); the lean reader is standard library only, imported from the checkout:
  /tmp/lb-peers/aiperf/bin/python benchmarks/http_layers.py --url http://127.0.0.1:18531 --levels 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import time
import urllib.request

from _common import ints  # puts the checkout on sys.path: a peer's venv has no lanebench installed

from tasks.client import http as lean

BODY = {"model": "fake", "prompt": "benchmark prompt", "stream": True}


async def _streams(c: int, n: int, post, chunks) -> int:
    """`c` streams of `n` requests each, every body read to its end, each read stamped and kept."""
    events = 0

    async def stream() -> None:
        nonlocal events
        for _ in range(n):
            pieces = []
            async with post() as resp:
                async for data in chunks(resp):
                    pieces.append((time.perf_counter(), data))
            events += sum(d.count(b"\n\n") for _, d in pieces)
    await asyncio.gather(*(stream() for _ in range(c)))
    return events


async def _httpx(url: str, c: int, n: int, tokens: int) -> int:
    httpx, body = sys.modules["httpx"], {**BODY, "max_tokens": tokens}
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        return await _streams(c, n, lambda: client.stream("POST", "/v1/completions", json=body),
                              lambda resp: resp.aiter_raw())


async def _aiohttp(url: str, c: int, n: int, tokens: int) -> int:
    aiohttp, body = sys.modules["aiohttp"], {**BODY, "max_tokens": tokens}
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=c)) as session:
        return await _streams(c, n, lambda: session.post("/v1/completions", json=body),
                              lambda resp: resp.content.iter_any())


async def _lean(url: str, c: int, n: int, tokens: int) -> int:
    host, port = url.split("//")[1].split(":")
    payload = lean.request_bytes(host, int(port), "/v1/completions", json.dumps({**BODY, "max_tokens": tokens}).encode())
    pool = lean.Pool(host, int(port), c)
    events = 0

    async def stream() -> None:
        nonlocal events
        for _ in range(n):
            conn, _ = await pool.acquire()
            conn.proto.write(payload)
            resp = await lean.read_response(conn)
            pool.release(conn, resp.reused)
            events += sum(d.count(b"\n\n") for _, d in resp.pieces)
    await asyncio.gather(*(stream() for _ in range(c)))
    pool.close()
    return events


def _connections(url: str) -> int:
    with urllib.request.urlopen(f"{url}/stats") as r:
        return json.load(r)["connections"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--levels", type=ints, default="1,16,64")
    p.add_argument("--requests", type=int, default=4, help="per stream")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--layers", default="httpx,aiohttp,lean", help="comma list of httpx, aiohttp, lean")
    args = p.parse_args()
    every = {"httpx": ("httpx", _httpx), "aiohttp": ("aiohttp", _aiohttp), "lean": ("lean asyncio", _lean)}
    chosen = args.layers.split(",")
    if unknown := [x for x in chosen if x not in every]:
        print(f"http_layers.py: --layers: unknown layer {unknown[0]!r}; choose from {', '.join(every)}",
              file=sys.stderr)
        return 2
    for name in chosen:
        if name != "lean":
            importlib.import_module(name)  # before any timing: an import is not a layer's cost
    rows = []
    for c in args.levels:
        for name, fn in (every[x] for x in chosen):
            before = _connections(args.url)
            cpu0, t0 = time.process_time(), time.perf_counter()
            events = asyncio.run(fn(args.url, c, args.requests, args.tokens))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            rows.append({"layer": name, "C": c, "events/s": round(events / wall), "client CPU s/s": round(cpu / wall, 2),
                         "CPU us/event": round(1e6 * cpu / max(events, 1), 1),
                         "connections": _connections(args.url) - before - 1})
            print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
