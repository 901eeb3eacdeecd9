"""A wave's load spread over worker processes, on one clock.

One asyncio process tops out at one core's worth of streamed events (docs/benchmarks.md, "The
load generator"); a server streaming more than that needs several. Each worker process runs
its share of the wave with the one-process client (`waves.run_part`): closed loop, the streams
whose number is the worker's index modulo the worker count; open loop, those requests of the
one schedule, drawn once here, each still sent at its own scheduled time, so the arrival process
is exactly the one-process one. The in-flight ceiling is split over the workers.

One clock: every stamp is `time.perf_counter()`, CLOCK_MONOTONIC, the same clock in every process
on the host; the workers start their share at one `t0` handed to them after all of them are up
(a spawned interpreter takes a second or more to import), so `sent_s`, `scheduled_s` and every
arrival are on the wave's one timeline and merge into the same records one process writes.
Records reach `on_record` as each worker finishes them, not at the wave's end. A request past
its deadline stops new sends in its own worker only; the others stop at their own deadlines.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import cast
from multiprocessing.connection import Connection, wait

from tasks.client import auth
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.client.waves import Wave, WaveResult, run_part
from tasks.engines.base import Engine

START_MARGIN_S = 0.1  # from handing out t0 to t0: every worker has it before the wave starts
READY_TIMEOUT_S = 120.0  # a worker that has not imported by then is broken, not slow


def _worker(conn: Connection, base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
            part: tuple[int, int], cpus: list[int] | None, keys: dict[str, str]) -> None:
    """One worker: report ready, take t0, run its share, send each record as it ends. `keys`:
    the API keys of the parent's servers (a spawned interpreter starts with none), over the pipe."""
    auth.install(keys)
    if cpus:
        os.sched_setaffinity(0, {cpus[part[0] % len(cpus)]})
    conn.send("ready")
    t0 = conn.recv()
    result = run_part(base_url, engine, wave, prompts, lambda r: conn.send(("record", r)), part, t0)
    result.records = []  # already sent one by one
    conn.send(("done", result))
    conn.close()


def run_spread(base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
               on_record: Callable[[RequestRecord], None] | None = None,
               cpus: list[int] | None = None) -> WaveResult:
    """Run `wave` over min(workers, concurrency) processes (pinned round-robin to `cpus` when
    given) and merge what they measured into one WaveResult."""
    count = min(wave.workers, wave.concurrency)
    ctx = mp.get_context("spawn")  # not fork: the parent may hold Prefect's threads and loops
    procs, conns = [], []
    for index in range(count):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, base_url, engine, wave, prompts, (index, count), cpus,
                                                   auth.snapshot()),
                           daemon=True, name=f"wave-worker-{index}")
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for index, conn in enumerate(conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())) or conn.recv() != "ready":
                raise RuntimeError(f"wave worker {index} did not start within {READY_TIMEOUT_S:g} s")
        t0 = time.perf_counter() + START_MARGIN_S
        for conn in conns:
            conn.send(t0)
        records: list[RequestRecord] = []
        parts: dict[int, WaveResult] = {}
        live = {conn: index for index, conn in enumerate(conns)}
        while live:
            for conn in cast("list[Connection]", wait(list(live))):  # wait() returns what it was given
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    index = live[conn]
                    procs[index].join(5)
                    raise RuntimeError(f"wave worker {index} died (exit code {procs[index].exitcode}) "
                                       "before it finished its share of the wave") from None
                if kind == "record":
                    records.append(payload)
                    if on_record:
                        on_record(payload)
                else:
                    parts[live.pop(conn)] = payload
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        for conn in conns:
            conn.close()
    records.sort(key=lambda r: r.sent_s or 0.0)
    results = list(parts.values())
    return WaveResult(
        records=records, wall_s=max(r.wall_s for r in results),
        connections_opened=sum(r.connections_opened for r in results),
        server_closed=sum(r.server_closed for r in results),
        loop_lag_p99_s=max(r.loop_lag_p99_s for r in results),
        loop_lag_max_s=max(r.loop_lag_max_s for r in results),
        client_cpu=max(r.client_cpu for r in results),  # the busiest worker: a saturated one is what matters
        client_cpu_s=sum(r.client_cpu_s for r in results),
        shape=wave.shape.describe())
