"""A wave's load spread over worker processes, on one clock.

One asyncio process tops out at one core's worth of streamed events (docs/benchmarks.md, "The load
generator"), and a wave in the flow process shares its GIL with Prefect's log and event threads: on an
H200 the client-bound flag fired from C=8 in the nightly while the same client alone stayed at the
probe's floor (issue 23). Each worker runs `waves.run_part` on its share: closed loop, the streams
whose number is its index modulo the worker count; open loop, those requests of the one schedule drawn
here, each at its own time, so the arrival process is the one-process one. The in-flight ceiling is split.

Workers are kept between waves, one pool per (count, cpus): a spawned interpreter takes a second or
more to import, paid 21 times by a 21-wave decode curve otherwise. A dead worker takes its pool with it.

Every stamp is `time.perf_counter()` (CLOCK_MONOTONIC, one clock for every process on the host) and the
workers start at one `t0` handed out once all hold the wave, so their records merge onto one timeline.
Records reach `on_record` as each ends. A request past its deadline stops new sends in its own worker only.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import cast
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from tasks.client import auth
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.client.waves import Wave, WaveResult, run_part
from tasks.engines.base import Engine

START_MARGIN_S = 0.1  # from handing out t0 to t0: every worker has it before the wave starts
READY_TIMEOUT_S = 120.0  # a worker that has not imported by then is broken, not slow


def _serve(conn: Connection, index: int, cpus: tuple[int, ...] | None) -> None:
    """One worker, pinned once; per wave: take it (with the parent's API keys: a spawned interpreter
    has none), say ready, take t0, run its share, send each record as it ends."""
    if cpus:
        os.sched_setaffinity(0, {cpus[index % len(cpus)]})
    while (job := conn.recv()) is not None:
        base_url, engine, wave, prompts, part, keys = job
        auth.install(keys)
        conn.send("ready")
        t0 = conn.recv()
        result = run_part(base_url, engine, wave, prompts, lambda r: conn.send(("record", r)), part, t0)
        result.records = []  # already sent one by one
        conn.send(("done", result))
    conn.close()


class _Pool:
    """`count` worker processes, started once and kept for the waves that follow."""

    def __init__(self, count: int, cpus: tuple[int, ...] | None):
        ctx = mp.get_context("spawn")  # not fork: the parent may hold Prefect's threads and loops
        pipes = [ctx.Pipe() for _ in range(count)]
        self.conns: list[Connection] = [parent for parent, _ in pipes]
        self.procs: list[BaseProcess] = [ctx.Process(target=_serve, args=(child, index, cpus), daemon=True,
                                                     name=f"wave-worker-{index}") for index, (_, child) in enumerate(pipes)]
        for proc, (_, child) in zip(self.procs, pipes):
            proc.start()
            child.close()

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that worker is gone already
                conn.send(None)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        for conn in self.conns:
            conn.close()


_pools: dict[tuple[int, tuple[int, ...] | None], _Pool] = {}


@atexit.register
def close_pools() -> None:
    """Stop every kept worker (also at the flow process's exit)."""
    while _pools:
        _pools.popitem()[1].close()


def run_spread(base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
               on_record: Callable[[RequestRecord], None] | None = None,
               cpus: list[int] | None = None) -> WaveResult:
    """Run `wave` over min(workers, concurrency) kept processes (pinned round-robin to `cpus` when
    given) and merge what they measured into one WaveResult."""
    count = min(wave.workers, wave.concurrency)
    key = (count, tuple(cpus) if cpus else None)
    if key in _pools and not all(proc.is_alive() for proc in _pools[key].procs):
        _pools.pop(key).close()
    if key not in _pools:
        _pools[key] = _Pool(*key)
    pool = _pools[key]
    keys = auth.snapshot()
    try:
        for index, conn in enumerate(pool.conns):
            conn.send((base_url, engine, wave, prompts, (index, count), keys))
        deadline = time.monotonic() + READY_TIMEOUT_S
        for index, conn in enumerate(pool.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())) or conn.recv() != "ready":
                raise RuntimeError(f"wave worker {index} did not start within {READY_TIMEOUT_S:g} s")
        t0 = time.perf_counter() + START_MARGIN_S
        for conn in pool.conns:
            conn.send(t0)
        records: list[RequestRecord] = []
        parts: dict[int, WaveResult] = {}
        live = {conn: index for index, conn in enumerate(pool.conns)}
        while live:
            for conn in cast("list[Connection]", wait(list(live))):  # wait() returns what it was given
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    index = live[conn]
                    pool.procs[index].join(5)
                    raise RuntimeError(f"wave worker {index} died (exit code {pool.procs[index].exitcode}) "
                                       "before it finished its share of the wave") from None
                if kind == "record":
                    records.append(payload)
                    if on_record:
                        on_record(payload)
                else:
                    parts[live.pop(conn)] = payload
    except BaseException:  # a dead worker or an interrupt: what the others hold mid-wave is lost
        _pools.pop(key, pool).close()
        raise
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
