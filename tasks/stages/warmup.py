"""Warmup: one wave per batch shape before anything is measured.

The first request at each batch shape pays one-time costs (kernel autotune, allocator growth,
page faults); a cold bench measured that as serving speed, a 5x error. Each shape gets a first-hit
and a steady wave; both are recorded, neither is a result.
"""

from __future__ import annotations

import statistics

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.engines import engine_for
from tasks.client.load import Wave, run_wave
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.record.progress import progress
from tasks.record.rows import WarmupRow
from tasks.serving import live
from tasks.serving.live import Endpoint


def _median(records: list[RequestRecord], field: str) -> float:
    values = [getattr(r, field) for r in records if r.ok and getattr(r, field) is not None]
    return statistics.median(values) if values else float("nan")


@task(name="warmup", cache_policy=NO_CACHE)
def warmup(endpoint: Endpoint, run_dir: str, shapes: list[tuple[int, str, int]],
           prompts: dict[str, list[Prompt]]) -> list[WarmupRow]:
    """shapes: (concurrency, size class, max_tokens) for every shape a later bench will use."""
    engine, lane_name = engine_for(endpoint.engine), endpoint.lane
    keep = live.keeper(run_dir, endpoint)
    rows: list[WarmupRow] = []
    gaps: list[float] = []
    ttfts: list[float] = []
    for concurrency, size_class, max_tokens in shapes:
        waves = []
        for _ in ("first-hit", "steady"):
            wave = Wave(lane=lane_name, stage="warmup", repeat=0, concurrency=concurrency,
                        requests_per_stream=1, max_tokens=max_tokens)
            waves.append(run_wave(endpoint.base_url, engine, wave, prompts[size_class], keep).records)
        first, steady = waves
        for r in steady:
            if r.ok:
                gaps += [b - a for a, b in zip(r.chunk_arrivals_s, r.chunk_arrivals_s[1:])]
                ttfts += [r.ttft_s] if r.ttft_s is not None else []
        rows.append(WarmupRow(
            lane=lane_name, concurrency=concurrency, size_class=size_class,
            first_hit_ttft_s=_median(first, "ttft_s"), first_hit_e2el_s=_median(first, "e2el_s"),
            steady_ttft_s=_median(steady, "ttft_s"), steady_e2el_s=_median(steady, "e2el_s"),
            first_hit_cost_s=_median(first, "e2el_s") - _median(steady, "e2el_s"),
            # A first hit faster than steady is the host's noise, never a negative cost.
            noise=_median(first, "e2el_s") < _median(steady, "e2el_s"),
        ))
    # The lane's own steady state bounds its later requests' stalls (tasks/serving/deadlines.py).
    if live.served(lane_name) and (words := live.handles(lane_name).late.set_stall_bounds(gaps, ttfts)):
        progress(lane_name, words)
    return rows
