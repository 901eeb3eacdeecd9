"""The concurrency curve past the cap, labelled for what it is: a queue.

Users asked the seeds' author to run past the running-request cap; a number measured there is
not a speed, it is a queue. A lane may declare `decode.beyond_cap.queue` levels: above the cap
the server resolved they run here, after the measured curve, through the same decode waves.
Their rows carry `regime="queueing"` (every table and plot says so, and the metrics the
regression check reads leave them out), and each gets a queueing row beside it: how long
requests waited before the server took them, apart from TTFT. The wait is each request's TTFT
less the TTFT p50 of the highest level inside the cap (its prefill and first token as a served
request has them); the engine's queue gauge (llama.cpp `requests_deferred`, SGLang
`num_queue_reqs`, vLLM `num_requests_waiting`) is sampled while the level runs.
"""

from __future__ import annotations

import threading
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


class _Sampler:
    """Polls the engine's queue gauge in a thread while a level runs."""

    def __init__(self, base_url: str, engine: Engine) -> None:
        self.url, self.engine = base_url + engine.metrics_path, engine
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, headers=auth.headers(self.url)) as client:
            while not self._stop.is_set():
                try:
                    r = client.get(self.url)
                    if r.status_code == 200:
                        self.values.append(self.engine.metrics(r.text).total(self.engine.queue_gauge or ""))
                except httpx.HTTPError:
                    pass
                self._stop.wait(_SAMPLE_S)

    def __enter__(self) -> _Sampler:
        if self.engine.queue_gauge:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


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
    """Each level past the cap through the decode waves, labelled queueing, with its queue row. Its
    records are kept but not judged against the wall deadline: a queued request may wait long."""
    engine, lane_name = engine_for(endpoint.engine), endpoint.lane
    inside = [r for r in measured if cap is None or r.concurrency <= cap]
    served = max(inside, key=lambda r: r.concurrency).ttft_p50_s if inside else None
    rows, queue = [], []
    for level in levels:
        kept: list[RequestRecord] = []

        def keep(rec: RequestRecord) -> None:
            kept.append(rec)  # noqa: B023 - called only while this level's waves run
            live.keep(run_dir, endpoint, rec, judged=False)

        with _Sampler(endpoint.base_url, engine) as sampler:
            [row] = measure(endpoint, plan.model_copy(update={"concurrency": [level]}), repeats, prompts, keep,
                            lambda s: progress(lane_name, f"{s} (queueing)"))
        rows.append(row.model_copy(update={"regime": "queueing"}))
        queue.append(queue_row(lane_name, level, cap, kept, served, engine.queue_gauge or "", sampler.values))
    return rows, queue
