"""Send waves of streamed requests and keep one raw record per request.

Closed loop: `concurrency` streams of `requests_per_stream` requests each (starts optionally staggered);
open loop: a Poisson or constant schedule with at most `concurrency` in flight. The pool opens at most
`concurrency` connections, reads every body to its end (so connections are reused) and counts what it opened.

Clocks, the frozen cycle collector and the lag probe (WaveResult.client_saturated): docs/metrics.md;
uvloop was measured and dropped (docs/benchmarks.md). A wall deadline, not a read timeout, bounds each
request (llama-server pings an idle stream every 30 s); once one request runs past it the wave sends no
new request, so a fault costs one deadline, not one per request left in the stream. Per request the loop
does only what the clocks need: records are built one per loop turn (recorder.py), one watchdog a wave.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from urllib.parse import urlsplit

from tasks.client import auth, http
from tasks.client.metrics import percentile
from tasks.client.prompts import Prompt, nonce, with_nonce
from tasks.client.deadline import request_deadline_s
from tasks.client.recorder import Builder, Recorder
from tasks.wire.records import RequestRecord, StreamEvent, truncation_of
from tasks.client.shapes import LoadShape
from tasks.client.stream import Assembler, Outcome
from tasks.engines.base import Engine

LAG_PROBE_S = 0.005  # how often the loop-lag probe wakes
LAG_LIMIT_S = 0.002  # p99 loop lag above this: stamps may be off by as much; the client is saturated
CPU_LIMIT = 0.9  # fraction of one core the client process used over the wave


@dataclass(frozen=True)
class Wave:
    """One wave's shape and where its records belong."""

    lane: str
    stage: str
    repeat: int
    concurrency: int
    requests_per_stream: int
    max_tokens: int
    stagger_s: float = 0.0
    rate: float | None = None  # requests/s: an open-loop wave with `concurrency` as its ceiling
    arrival: str = "poisson"
    deadline_s: float | None = None  # per request, wall clock; None: derived from max_tokens (client/deadline.py)
    seed: int = 0
    # From the lane's warm steady state (deadline.py `stall_bounds`): no token for `stall_s` mid-stream, or
    # for `first_token_stall_s` after the send, ends the request as a stall (None: only the deadline bounds it).
    stall_s: float | None = None
    first_token_stall_s: float | None = None
    workers: int = 1  # processes the wave's load is spread over (tasks/client/workers.py)

    def __post_init__(self) -> None:
        if self.deadline_s is None:
            object.__setattr__(self, "deadline_s", request_deadline_s(self.max_tokens))  # frozen

    @property
    def shape(self) -> LoadShape:
        return LoadShape(kind="open" if self.rate else "closed", concurrency=self.concurrency, stagger_s=self.stagger_s,
                         requests=self.concurrency * self.requests_per_stream, rate=self.rate, arrival=self.arrival, seed=self.seed)


STALL_POLL_S = 0.25  # how often the stall watchdog looks at each request's last token


@dataclass(repr=False)
class WaveResult:
    records: list[RequestRecord]
    wall_s: float
    connections_opened: int = 0
    server_closed: int = 0  # connections the server closed after a response (llama-server: every stream)
    loop_lag_p99_s: float = 0.0
    loop_lag_max_s: float = 0.0
    client_cpu: float = 0.0  # CPU seconds of this process over wall seconds (1.0 = one core busy); workers: the busiest
    client_cpu_s: float = 0.0  # CPU seconds of every client process over the wave (workers: their sum)
    shape: str = ""

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records if r.ok)

    def __repr__(self) -> str:
        # Short on purpose: asyncio.run's SIGINT restore (3.11) formats the main task's repr, its
        # result included, on every wave: a full repr of every record cost ~20 ms at 128 records.
        return f"WaveResult({len(self.records)} records, {self.wall_s:.3f} s, {self.shape!r})"

    @property
    def client_saturated(self) -> bool:
        return self.loop_lag_p99_s > LAG_LIMIT_S or self.client_cpu > CPU_LIMIT


class _Client:
    """What one wave's requests share: the pool, the wave's clock, the engine's spelling."""

    def __init__(self, base_url: str, engine: Engine, wave: Wave):
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.prefix, self.auth = url.path.rstrip("/"), auth.header_bytes(self.host, self.port)  # API key, if any
        self.engine, self.wave = engine, wave
        self.pool = http.Pool(self.host, self.port, wave.concurrency)
        self.t0 = time.perf_counter()
        self.late = False  # a request ran past its wall deadline or stalled: send no more
        self.flights: set[_Flight] = set()  # requests under the stall watchdog (wave.stall_s set)

    async def _exchange(self, payload: bytes, sink: Callable[[float, bytes], None],
                        flight: _Flight) -> tuple[http.Response, float, float | None, bool]:
        """Send on a pooled connection and read the whole response; a kept-alive connection the server
        has meanwhile closed is replaced once."""
        for attempt in (0, 1):
            # The retry takes a new connection: another idle one may be just as closed (llama-server closes every stream).
            conn, reused = await self.pool.acquire(fresh=attempt == 1)
            flight.conn = conn
            keep = False
            try:
                t_send = time.perf_counter()
                flight.acc.t_send = t_send
                conn.proto.write(payload)
                resp = await http.read_response(conn, sink)
                keep = resp.reused
                self.pool.server_closed += not keep  # `Connection: close` or a body ended by the close
                return resp, t_send, None if reused else conn.connect_s, reused
            except (http.HTTPError, ConnectionError) as e:
                if flight.stalled or not (reused and attempt == 0 and "before the response head" in str(e)):
                    raise
                self.pool.server_closed += 1  # it closed the kept-alive connection after the last response
            finally:
                self.pool.release(conn, keep)
        raise AssertionError("unreachable")

    async def watch(self) -> None:
        """Every STALL_POLL_S, close the connection of each request with no token for longer than the
        stall bound. One task per wave: a task per request woke 64 at once at C=64."""
        wave = self.wave
        while True:
            await asyncio.sleep(STALL_POLL_S)
            now = time.perf_counter()
            for f in list(self.flights):
                acc = f.acc
                if not acc.t_send or f.stalled is not None or f.conn is None:
                    continue
                arrivals = acc.out.arrivals
                since = arrivals[-1] if arrivals else 0.0
                gap = now - acc.t_send - since
                bound = wave.stall_s if arrivals else (wave.first_token_stall_s or wave.stall_s)
                if bound is not None and gap > bound:
                    start = acc.t_send - self.t0 + since  # the stall's span, from the wave's start
                    after = f"after {len(arrivals)} token chunks" if arrivals else "before the first token"
                    f.stalled = (f"stall: no token for {gap:.1f} s {after} (span {start:.2f}-{start + gap:.2f} s of the "
                                 f"wave; bound {bound:.1f} s from the lane's warm steady state)")
                    f.conn.proto.close()  # its read ends now; the request records the stall

    async def request(self, prompt: Prompt, stream: int | None, scheduled: float | None,
                      queued: float = 0.0) -> Builder:
        """Send one request and read its stream to the end; returns a builder of its record (recorder.py)."""
        wave, engine = self.wave, self.engine
        tag = nonce()
        spec = engine.completion_request(with_nonce(prompt.text, tag), wave.max_tokens)
        payload = http.request_bytes(self.host, self.port, self.prefix + spec.path, json.dumps(spec.body).encode(), self.auth)
        started = time.time()
        t_start = time.perf_counter()
        resp, t_send, connect_s, reused, error = None, None, None, False, None
        # Events are split and parsed piece by piece, each piece already stamped at its arrival.
        splitter, acc = http.EventSplitter(), Assembler(engine, 0.0)
        flight = _Flight(acc)

        def sink(t: float, data: bytes) -> None:
            acc.feed_read(splitter.feed(t, data))  # after an error event it ignores the rest

        if wave.stall_s:
            self.flights.add(flight)
        try:
            async with asyncio.timeout(wave.deadline_s):
                resp, t_send, connect_s, reused = await self._exchange(payload, sink, flight)
        except TimeoutError:
            error = f"deadline: no complete response within {wave.deadline_s:g} s (wall clock)"
            self.late = True
        except (OSError, http.HTTPError, asyncio.IncompleteReadError) as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            self.flights.discard(flight)
        if flight.stalled is not None:  # the watchdog cut it
            resp, error = None, flight.stalled
            self.late = True
        return partial(self._record, prompt, tag, started, t_start, time.perf_counter(), resp, t_send, connect_s, reused,
                       error, stream, scheduled, queued, splitter, acc)

    def _record(self, prompt: Prompt, tag: str, started: float, t_start: float, t_end: float, resp: http.Response | None,
                t_send: float | None, connect_s: float | None, reused: bool, error: str | None, stream: int | None,
                scheduled: float | None, queued: float, splitter: http.EventSplitter, acc: Assembler) -> RequestRecord:
        """The request's record from what it measured (no clock is read here: it runs later)."""
        wave = self.wave
        if error is not None and acc.out.error is not None:
            error = acc.out.error  # the server said why before the stream broke off: its words
        out, final = Outcome(), StreamEvent()  # what a request that never got a 2xx stream records
        if resp is not None and resp.status >= 400:
            body = b"".join(p for _, p in resp.pieces).decode(errors="replace")
            error = f"HTTP {resp.status}: {body[:300]}"
        elif resp is not None:
            for et, raw, shared in splitter.close():
                acc.feed(et, raw, shared)
            out = acc.finish()
            final, error = out.final or final, out.error
            if error is None and out.output_tokens == 0 and out.arrivals:  # never `ok` with 0 tokens (issue 27)
                error = f"no token count: the stream carried {len(out.arrivals)} token-bearing chunks and ended counting 0"
            t_end = resp.pieces[-1][0] if resp.pieces else t_end
        ok = error is None and resp is not None
        e2el = t_end - t_send if ok and t_send is not None else None
        ttft, tokens = out.ttft_s, out.output_tokens if ok else 0
        return RequestRecord(
            lane=wave.lane, stage=wave.stage,
            repeat=wave.repeat, concurrency=wave.concurrency, prompt_class=prompt.prompt_class,
            prompt_id=prompt.id, nonce=tag, max_tokens=wave.max_tokens, ok=ok,
            http_status=resp.status if resp else None, error=error, prompt_tokens=final.prompt_tokens,
            output_tokens=tokens, finish_reason=final.finish_reason, started_at=started, ttft_s=ttft, e2el_s=e2el,
            itl_p50_s=out.itl_p50_s(), chunks=len(out.arrivals), spec=final.spec, server_timings=final.timings,
            tpot_s=(e2el - ttft) / (tokens - 1) if e2el is not None and ttft is not None and tokens > 1 else None,
            stream=stream, sent_s=(t_send if t_send is not None else t_start) - self.t0,
            ended_s=t_end - self.t0, scheduled_s=scheduled, queued_s=queued, connect_s=connect_s,
            reused_connection=reused, chunk_arrivals_s=out.arrivals, chunk_tokens=out.tokens,
            chunk_coalesced=out.coalesced, events=out.events, deadline_s=wave.deadline_s,
            truncation=truncation_of(ok, final.finish_reason, tokens, wave.max_tokens, final.truncated),
        )


@dataclass(eq=False)
class _Flight:
    """One request in flight, as the stall watchdog sees it."""

    acc: Assembler
    conn: http.Connection | None = None
    stalled: str | None = None  # the watchdog cut it: why


async def _probe_loop(lags: list[float]) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        lags.append(max(0.0, time.perf_counter() - t - LAG_PROBE_S))


async def _run_wave(base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
                    on_record: Callable[[RequestRecord], None] | None, part: tuple[int, int] = (0, 1),
                    t0: float | None = None) -> WaveResult:
    """The wave, or part `(index, count)` of it: the streams (closed loop) or scheduled requests
    (open loop) whose number is `index` modulo `count`, on a clock that starts at `t0` (a
    perf_counter value, CLOCK_MONOTONIC: the same in every process on the host; None: now)."""
    client = _Client(base_url, engine, wave)
    shape = wave.shape
    recorder = Recorder(on_record)
    keep = recorder.put
    index, count = part
    mine = range(index, wave.concurrency, count)  # closed loop: these streams; open loop: this ceiling

    async def closed_stream(i: int) -> None:
        if (delay := client.t0 + i * shape.stagger_s - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        for j in range(wave.requests_per_stream):
            if client.late:
                return
            keep(await client.request(prompts[(i * wave.requests_per_stream + j) % len(prompts)], i, None))

    async def open_loop() -> None:
        ceiling = asyncio.Semaphore(len(mine))  # the wave's ceiling, split over the parts

        async def one(k: int, at: float) -> None:
            t = time.perf_counter()
            async with ceiling:
                if client.late:
                    return
                keep(await client.request(prompts[k % len(prompts)], None, at, time.perf_counter() - t))

        tasks = []
        for k, at in list(enumerate(shape.schedule()))[index::count]:
            if (delay := client.t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(k, at)))
        await asyncio.gather(*tasks)

    lags: list[float] = []
    probe = asyncio.create_task(_probe_loop(lags))
    watch = asyncio.create_task(client.watch()) if wave.stall_s else None
    cpu0 = time.process_time()
    client.t0 = time.perf_counter() if t0 is None else t0
    try:
        if shape.kind == "open":
            await open_loop()
        else:
            await asyncio.gather(*(closed_stream(i) for i in mine))
    finally:
        wall = time.perf_counter() - client.t0
        cpu = time.process_time() - cpu0
        probe.cancel()
        if watch is not None:
            watch.cancel()
        client.pool.close()
        records = await recorder.close()  # the last records kept (the wave's clocks are already read)
    records.sort(key=lambda r: r.sent_s or 0.0)
    return WaveResult(records=records, wall_s=wall, connections_opened=client.pool.opened,
                      server_closed=client.pool.server_closed, loop_lag_p99_s=percentile(lags, 99, 0.0),
                      loop_lag_max_s=max(lags, default=0.0), client_cpu=cpu / wall if wall > 0 else 0.0,
                      client_cpu_s=cpu, shape=shape.describe())


def run_part(base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
             on_record: Callable[[RequestRecord], None] | None = None, part: tuple[int, int] = (0, 1),
             t0: float | None = None) -> WaveResult:
    """One process's share of a wave (all of it by default), blocking."""
    # The imported libraries' hundreds of thousands of objects are set aside from the cycle collector:
    # a full collection scanned them all, stopping the loop for tens of ms amid the wave's clocks.
    gc.freeze()
    try:
        return asyncio.run(_run_wave(base_url, engine, wave, prompts, on_record, part, t0))
    finally:
        gc.unfreeze()
