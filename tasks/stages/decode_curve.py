"""Decode curve: aggregate and per-user speed at each concurrency level, repeated.

Each level runs `repeats` measured waves after warmup. Aggregate tok/s is a wave's output
tokens over its wall time; the row reports the median over repeats with min, max and
spread. Per-user tok/s, TTFT and ITL pool every measured request at that level.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.stages.boot import Server
from tasks.inventory.models import DecodePlan
from tasks.engines import engine_for
from tasks.client.waves import Wave, run_wave
from tasks.client.prompts import Prompt
from tasks.client.records import RequestRecord
from tasks.hosts import noise as host_noise
from tasks.hosts.noise import DEFAULT_UNSTABLE_SPREAD_PCT, Noise
from tasks.record.rows import DecodeRow


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(lane_name: str, concurrency: int, waves: list[tuple[list[RequestRecord], float]],
              noise: list[Noise] | None = None, unstable_spread_pct: float = DEFAULT_UNSTABLE_SPREAD_PCT) -> DecodeRow:
    """One row from the measured waves of one concurrency level, with the host's noise."""
    aggregates = [sum(r.output_tokens for r in recs if r.ok) / wall for recs, wall in waves]
    records = [r for recs, _ in waves for r in recs]
    good = [r for r in records if r.ok]
    per_user = [r.output_tokens / (r.e2el_s - r.ttft_s) for r in good
                if r.e2el_s and r.ttft_s is not None and r.e2el_s > r.ttft_s and r.output_tokens > 1]
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    itls = [r.itl_p50_s for r in good if r.itl_p50_s is not None]
    median = statistics.median(aggregates)
    spread = 100.0 * (max(aggregates) - min(aggregates)) / median if median else float("nan")
    busy = [n.busy_pct for n in noise or [] if n.busy_pct is not None]
    steal = [n.steal_pct for n in noise or [] if n.steal_pct is not None]
    loads = [n.load_1m_before for n in noise or [] if n.load_1m_before is not None]
    return DecodeRow(
        load_1m_before=max(loads) if loads else None, busy_pct=statistics.median(busy) if busy else None,
        steal_pct=max(steal) if steal else None, unstable=not spread <= unstable_spread_pct,
        context_truncated_share=sum(r.truncation == "context" for r in records) / len(records) if records else 0.0,
        lane=lane_name, concurrency=concurrency, repeats=len(waves),
        aggregate_tok_s=median, aggregate_tok_s_min=min(aggregates), aggregate_tok_s_max=max(aggregates),
        aggregate_spread_pct=spread,
        per_user_tok_s=statistics.median(per_user) if per_user else float("nan"),
        ttft_p50_s=_pct(ttfts, 50), ttft_p95_s=_pct(ttfts, 95), itl_p50_s=_pct(itls, 50),
        requests=len(records), failed_requests=len(records) - len(good),
    )


@task(name="decode-curve", cache_policy=NO_CACHE)
def decode_curve(server: Server, lane_name: str, engine_name: str, plan: DecodePlan, repeats: int,
                 prompts: list[Prompt], on_record: Callable[[RequestRecord], None],
                 on_progress: Callable[[str], None] = lambda _: None,
                 unstable_spread_pct: float = DEFAULT_UNSTABLE_SPREAD_PCT) -> list[DecodeRow]:
    engine = engine_for(engine_name)
    rows = []
    for concurrency in plan.concurrency:
        waves, noise = [], []
        for repeat in range(1, repeats + 1):
            on_progress(f"decode curve c={concurrency} repeat {repeat}/{repeats}")
            wave = Wave(lane=lane_name, stage="decode", repeat=repeat, concurrency=concurrency,
                        requests_per_stream=plan.requests_per_stream, max_tokens=plan.max_tokens)
            before = host_noise.sample()
            result = run_wave(server.base_url, engine, wave, prompts, on_record)
            noise.append(host_noise.between(before, host_noise.sample()))
            waves.append((result.records, result.wall_s))
        rows.append(summarize(lane_name, concurrency, waves, noise, unstable_spread_pct))
    return rows
