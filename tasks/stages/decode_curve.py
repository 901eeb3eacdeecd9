"""Decode curve: aggregate and per-user speed at each load level, repeated.

Each level (a concurrency, or an open-loop request rate) runs `repeats` measured waves. Aggregate
tok/s is a wave's tokens inside its steady window over its length (docs/metrics.md), the median
over repeats; TTFT, TPOT and ITL pool every request at the level.
"""

from __future__ import annotations

import statistics
from typing import Any
from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.client import metrics
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.client.load import Wave, WaveResult, run_wave
from tasks.engines import engine_for
from tasks.hosts import noise as host_noise
from tasks.hosts.noise import DEFAULT_UNSTABLE_SPREAD_PCT, Noise
from tasks.inventory.models import DecodePlan
from tasks.record.progress import progress
from tasks.record.rows import DecodeRow
from tasks.serving import live
from tasks.serving.live import Endpoint


def _nan(v: float | None) -> float:
    return float("nan") if v is None else v


def summarize(lane_name: str, concurrency: int, waves: list[WaveResult], ttft_bound_s: float | None = None,
              tpot_bound_s: float | None = None, request_rate: float | None = None, noise: list[Noise] | None = None,
              unstable_spread_pct: float = DEFAULT_UNSTABLE_SPREAD_PCT) -> DecodeRow:
    """One row from the measured waves of one level, with the host's noise around them."""
    windows = [metrics.steady_window(w.records, w.wall_s) for w in waves]
    wave_rates = [w.output_tokens / w.wall_s for w in waves]
    # A wave with no steady window (every stream never ran at once) falls back to its all-in rate.
    aggregates = [win.tok_s if win.steady else rate for win, rate in zip(windows, wave_rates)]
    server = _server_rates(waves, windows)
    records = [r for w in waves for r in w.records]
    ok = [r for r in records if r.ok]
    # per request, tokens after the first over the time after the first: 1 / TPOT (docs/metrics.md)
    per_user = [1.0 / r.tpot_s for r in ok if r.tpot_s]
    if not per_user:
        # No TPOT: each reply came in one read (a near-perfect drafter, coalesced events). Tokens
        # over the whole latency is then the only per-user figure, a lower bound (it counts TTFT).
        per_user = [r.output_tokens / r.e2el_s for r in ok if r.e2el_s and r.output_tokens]
    ttft = metrics.percentiles([r.ttft_s for r in ok if r.ttft_s is not None])
    tpot = metrics.percentiles([r.tpot_s for r in ok if r.tpot_s is not None])
    itl = metrics.percentiles(metrics.pooled_itl(ok))
    chunks = sum(r.chunks for r in ok)
    bounded = ttft_bound_s is not None or tpot_bound_s is not None
    n_good = [sum(metrics.good(r, ttft_bound_s, tpot_bound_s) for r in w.records) for w in waves]
    median = statistics.median(aggregates)
    spread = 100.0 * (max(aggregates) - min(aggregates)) / median if median else float("nan")
    busy = [n.busy_pct for n in noise or [] if n.busy_pct is not None]
    steal = [n.steal_pct for n in noise or [] if n.steal_pct is not None]
    loads = [n.load_1m_before for n in noise or [] if n.load_1m_before is not None]
    return DecodeRow(
        load_1m_before=max(loads) if loads else None, busy_pct=statistics.median(busy) if busy else None,
        steal_pct=max(steal) if steal else None, unstable=not spread <= unstable_spread_pct,
        context_truncated_share=sum(r.truncation == "context" for r in records) / len(records) if records else 0.0,
        ttft_share_p50=statistics.median(shares)
        if (shares := [r.ttft_s / r.e2el_s for r in ok if r.e2el_s and r.ttft_s is not None]) else None,
        lane=lane_name, concurrency=concurrency, repeats=len(waves),
        aggregate_tok_s=median, aggregate_tok_s_min=min(aggregates), aggregate_tok_s_max=max(aggregates),
        aggregate_spread_pct=spread,
        per_user_tok_s=statistics.median(per_user) if per_user else float("nan"),
        ttft_p50_s=_nan(ttft[50]), ttft_p95_s=_nan(ttft[95]), itl_p50_s=_nan(itl[50]),
        requests=len(records), failed_requests=len(records) - len(ok),
        load_shape=waves[0].shape, request_rate=request_rate, ttft_p90_s=ttft[90], ttft_p99_s=ttft[99],
        tpot_p50_s=tpot[50], tpot_p90_s=tpot[90], tpot_p95_s=tpot[95], tpot_p99_s=tpot[99],
        itl_p90_s=itl[90], itl_p95_s=itl[95], itl_p99_s=itl[99],
        tokens_per_chunk=sum(r.output_tokens for r in ok) / chunks if chunks else None,
        tokens_per_chunk_max=max((n for r in ok for n in r.chunk_tokens), default=None),
        wave_tok_s=statistics.median(wave_rates),
        ramp_up_s=statistics.median(w.ramp_up_s for w in windows),
        ramp_down_s=statistics.median(w.ramp_down_s for w in windows),
        steady_window_s=statistics.median(max(0.0, w.end_s - w.start_s) for w in windows),
        ttft_bound_s=ttft_bound_s, tpot_bound_s=tpot_bound_s,
        goodput_req_s=statistics.median(g / w.wall_s for g, w in zip(n_good, waves)) if bounded else None,
        goodput_pct=100.0 * sum(n_good) / len(records) if bounded and records else None,
        connections_opened=max(w.connections_opened for w in waves),
        server_closed_connections=max(w.server_closed for w in waves),
        unforced_reconnects=max(max(0, w.connections_opened - concurrency - w.server_closed) for w in waves),
        client_loop_lag_p99_s=max(w.loop_lag_p99_s for w in waves),
        client_cpu=max(w.client_cpu for w in waves),
        client_saturated=any(w.client_saturated for w in waves),
        coalesced_share=metrics.coalesced_share(ok),
        server_tok_s=statistics.median(server) if server else None,
        server_gap_pct=100.0 * (median - statistics.median(server)) / statistics.median(server)
        if server and statistics.median(server) > 0 else None,
        **_open_loop(waves) if request_rate is not None else {},
    )


def _server_rates(waves: list[WaveResult], windows: list[metrics.Window]) -> list[float]:
    """Per wave with a steady window: the server's own timings' tokens in it over its length."""
    rates = []
    for w, win in zip(waves, windows):
        tokens = metrics.server_window_tokens(w.records, win) if win.steady else None
        if tokens is not None:
            rates.append(tokens / (win.end_s - win.start_s))
    return rates


def _open_loop(waves: list[WaveResult]) -> dict[str, Any]:
    """The rate the waves really sent at, and the load generator's own lateness per request."""
    rates, late = [], []
    for w in waves:
        sent = sorted(r.sent_s for r in w.records if r.sent_s is not None)
        if len(sent) > 1 and sent[-1] > sent[0]:
            rates.append((len(sent) - 1) / (sent[-1] - sent[0]))
        late += [r.sent_s - r.scheduled_s - r.queued_s for r in w.records
                 if r.sent_s is not None and r.scheduled_s is not None]
    q = metrics.percentiles(late)
    return {"realized_rate": statistics.median(rates) if rates else None,
            "send_late_p50_s": q[50], "send_late_p99_s": q[99]}


def levels(plan: DecodePlan) -> list[tuple[int, float | None]]:
    """The sweep: (concurrency or ceiling, rate) per level."""
    if plan.rates:
        return [(max(plan.concurrency), rate) for rate in plan.rates]
    return [(c, None) for c in plan.concurrency]


@task(name="decode-curve", cache_policy=NO_CACHE)
def decode_curve(endpoint: Endpoint, run_dir: str, plan: DecodePlan, repeats: int, prompts: list[Prompt],
                 unstable_spread_pct: float = DEFAULT_UNSTABLE_SPREAD_PCT) -> list[DecodeRow]:
    """Every level's waves, the server checked before each (tasks/serving/deadlines.py), each record kept."""

    def each_wave(what: str) -> None:
        live.check(endpoint)
        progress(endpoint.lane, what)

    return measure(endpoint, plan, repeats, prompts, live.keeper(run_dir, endpoint), each_wave,
                   unstable_spread_pct)


def measure(endpoint: Endpoint, plan: DecodePlan, repeats: int, prompts: list[Prompt],
            on_record: Callable[[RequestRecord], None], on_wave: Callable[[str], None],
            unstable_spread_pct: float = DEFAULT_UNSTABLE_SPREAD_PCT) -> list[DecodeRow]:
    """The curve itself, records and the moment before each wave handed to the caller."""
    engine, lane_name = engine_for(endpoint.engine), endpoint.lane
    late = live.handles(lane_name).late if live.served(lane_name) else None
    rows = []
    for concurrency, rate in levels(plan):
        waves, noise = [], []
        for repeat in range(1, repeats + 1):
            wave = Wave(lane=lane_name, stage="decode", repeat=repeat, concurrency=concurrency,
                        requests_per_stream=plan.per_stream(concurrency, repeats), max_tokens=plan.max_tokens,
                        stagger_s=plan.stagger_s, rate=rate, arrival=plan.arrival, deadline_s=plan.deadline_s,
                        seed=repeat, workers=plan.workers, stall_s=late.stall_s if late else None,
                        first_token_stall_s=late.first_token_stall_s if late and rate is None else None)
            on_wave(f"decode curve {wave.shape.describe()} repeat {repeat}/{repeats}")
            before = host_noise.sample()
            waves.append(run_wave(endpoint.base_url, engine, wave, prompts, on_record))
            noise.append(host_noise.between(before, host_noise.sample()))
        rows.append(summarize(lane_name, concurrency, waves, plan.ttft_bound_s, plan.tpot_bound_s, rate, noise,
                              unstable_spread_pct))
    return rows
