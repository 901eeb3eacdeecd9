"""The concurrency curve past the cap, labelled for what it is: a queue.

A number measured past the running-request cap is not a speed. `decode.beyond_cap.queue` levels
above the cap run here, after the curve, through the same waves; their rows carry
`regime="queueing"` (regression metrics leave them out), each with a queue row: the wait is each
request's TTFT less the TTFT p50 of the highest level inside the cap, and the engine's queue
gauge (llama.cpp `requests_deferred`, SGLang `num_queue_reqs`, vLLM `num_requests_waiting`) is
sampled while the level runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from math import nan

import httpx
import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.client import auth
from tasks.client.metrics import percentile
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.engines import Engine, engine_for
from tasks.inventory.models import DecodePlan
from tasks.record.progress import progress
from tasks.record.rows import DecodeRow
from tasks.serving import live
from tasks.stages.decode_curve import measure
from tasks.serving.live import Endpoint
from tasks.record.table_rows import QueueRow

_SAMPLE_S = 0.1


@contextmanager
def _sampled(base_url: str, engine: Engine) -> Iterator[list[float]]:
    """The engine's queue gauge, polled in a thread while the block runs."""
    url, stop = base_url + engine.metrics_path, threading.Event()
    values: list[float] = []

    def poll() -> None:
        with httpx.Client(timeout=5.0, headers=auth.headers(url)) as client:
            while not stop.is_set():
                with suppress(httpx.HTTPError):
                    r = client.get(url)
                    if r.status_code == 200:
                        values.append(engine.metrics(r.text).total(engine.queue_gauge or ""))
                stop.wait(_SAMPLE_S)

    thread = threading.Thread(target=poll, daemon=True)
    if engine.queue_gauge:
        thread.start()
    try:
        yield values
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=10)


def queue_row(lane_name: str, concurrency: int, cap: int | None, records: list[RequestRecord],
              served_ttft: float | None, gauge: str, samples: list[float]) -> QueueRow:
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    served = served_ttft if served_ttft is not None and served_ttft == served_ttft else min(ttfts, default=0.0)
    waits = [max(0.0, t - served) for t in ttfts]
    return QueueRow(lane=lane_name, concurrency=concurrency, running_cap=cap,
                    beyond_cap=max(0, concurrency - (cap or concurrency)), requests=len(records),
                    ttft_p50_s=percentile(ttfts, 50, nan), ttft_p95_s=percentile(ttfts, 95, nan), served_ttft_p50_s=served,
                    queue_wait_p50_s=percentile(waits, 50, nan), queue_wait_p95_s=percentile(waits, 95, nan), queue_gauge=gauge,
                    deferred_peak=max(samples) if samples else None,
                    deferred_mean=float(np.mean(samples)) if samples else None)


@task(name="queueing-levels", cache_policy=NO_CACHE)
def queueing_levels(endpoint: Endpoint, run_dir: str, plan: DecodePlan, repeats: int, prompts: list[Prompt],
                    levels: list[int], cap: int | None, measured: list[DecodeRow]) -> tuple[list[DecodeRow], list[QueueRow]]:
    """Each level past the cap, labelled queueing, with its queue row; records kept, not judged against
    the wall deadline (a queued request may wait long)."""
    engine, lane_name = engine_for(endpoint.engine), endpoint.lane
    inside = [r for r in measured if cap is None or r.concurrency <= cap]
    served = max(inside, key=lambda r: r.concurrency).ttft_p50_s if inside else None
    rows, queue = [], []
    for level in levels:
        kept: list[RequestRecord] = []

        def keep(rec: RequestRecord) -> None:
            kept.append(rec)  # noqa: B023 - called only while this level's waves run
            live.keep(run_dir, endpoint, rec, judged=False)

        with _sampled(endpoint.base_url, engine) as samples:
            [row] = measure(endpoint, plan.model_copy(update={"concurrency": [level]}), repeats, prompts, keep,
                            lambda s: progress(lane_name, f"{s} (queueing)"))
        rows.append(row.model_copy(update={"regime": "queueing"}))
        queue.append(queue_row(lane_name, level, cap, kept, served, engine.queue_gauge or "", samples))
    return rows, queue
