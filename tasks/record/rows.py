"""The rows of the result tables and gate verdicts, in the field's own words
(acceptance length, per-position acceptance, warmup wave)."""

from __future__ import annotations

from typing import Literal

from pydantic import JsonValue

from tasks.wire.base import InFlight, Record


class Finding(Record):
    """A lane flag: one declared value the server does not serve as declared, a value too good to be
    true, or a number the night passed but does not vouch for (tasks/stages/safety.py, the nightly)."""

    check: str
    declared: JsonValue = None
    effective: JsonValue = None
    severity: Literal["failure", "flag"]
    message: str  # names declared value, effective value and the fix


class GateResult(Record):
    gate: str
    kind: str
    passed: bool
    value: float | None
    op: str
    threshold: float | None
    detail: str
    # Time with requests in flight: measuring, for benchmarks/nightly_overhead.py.
    requests: list[InFlight] = []


class WarmupRow(Record):
    lane: str
    concurrency: int
    size_class: str
    first_hit_ttft_s: float
    first_hit_e2el_s: float
    steady_ttft_s: float
    steady_e2el_s: float
    first_hit_cost_s: float  # first-hit e2el minus steady e2el: what a cold bench would have mixed in
    noise: bool = False  # first hit faster than steady: the host's noise, not a negative cost


class DecodeRow(Record):
    lane: str
    concurrency: int
    repeats: int
    aggregate_tok_s: float
    aggregate_tok_s_min: float
    aggregate_tok_s_max: float
    aggregate_spread_pct: float
    per_user_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_s: float  # pooled over every gap between chunks (docs/metrics.md), not a median of medians
    requests: int
    failed_requests: int
    # Host noise around the waves (tasks/hosts/noise.py) and the verdict on the spread.
    load_1m_before: float | None = None
    busy_pct: float | None = None  # median over the repeats' waves
    steal_pct: float | None = None  # highest over the repeats' waves
    unstable: bool = False  # spread above the lane's bench.unstable_spread_pct: noise, not a number
    context_truncated_share: float = 0.0  # measured requests cut or shifted by the context
    # Median TTFT / e2e latency: above one half the row measures prefill and queueing, not decode
    # (the seeds' max_tokens: 4 published 604 tok/s per user).
    ttft_share_p50: float | None = None
    # C=1 on a host with `memory_gbps`: model bytes read per second / memory bandwidth (tasks/stages/limits.py).
    bandwidth_share: float | None = None
    # "queueing": a level the lane declared beyond_cap and ran above the server's cap; never judged for speed
    regime: Literal["measured", "queueing"] = "measured"
    # The load generator's fuller picture (docs/metrics.md); defaults keep older rows readable.
    load_shape: str = ""  # e.g. "closed c=8, stagger 0.01 s" or "open poisson 4 req/s, ceiling 8"
    request_rate: float | None = None  # open loop: requests/s sent; None for closed loop
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_p95_s: float | None = None
    tpot_p99_s: float | None = None
    itl_p90_s: float | None = None
    itl_p95_s: float | None = None
    itl_p99_s: float | None = None
    tokens_per_chunk: float | None = None  # output tokens / chunks: > 1 means bursts (speculation)
    tokens_per_chunk_max: int | None = None
    wave_tok_s: float | None = None  # median over repeats of all tokens / wave wall time, ramps included
    ramp_up_s: float | None = None  # median over repeats
    ramp_down_s: float | None = None
    steady_window_s: float | None = None  # 0 when no window had every stream busy (then aggregate = wave_tok_s)
    ttft_bound_s: float | None = None
    tpot_bound_s: float | None = None
    goodput_req_s: float | None = None  # median over repeats of requests within both bounds / wave wall time
    goodput_pct: float | None = None  # share of requests within both bounds
    connections_opened: int | None = None  # most any measured wave opened (closed loop: should equal concurrency)
    server_closed_connections: int | None = None  # most any wave saw the server close after a response
    unforced_reconnects: int | None = None  # opened beyond concurrency that no server close forced: must be 0
    client_loop_lag_p99_s: float | None = None  # worst wave's event-loop lag p99
    client_cpu: float | None = None  # worst wave's client CPU, in cores
    client_saturated: bool = False  # the client, not the server, may have set these numbers
    # Share of chunks whose read also carried a later event (stamp an upper bound, gaps left out of ITL).
    coalesced_share: float | None = None
    # The engine's own clock (llama.cpp's `timings`) over the same steady window, and the client's
    # aggregate's gap from it in % (tasks/client/metrics.py server_window_tokens).
    server_tok_s: float | None = None
    server_gap_pct: float | None = None
    # Open loop: requests/s really sent ((sent - 1) / first-to-last send), and the load generator's
    # own lateness (send - scheduled - queued under the ceiling).
    realized_rate: float | None = None
    send_late_p50_s: float | None = None
    send_late_p99_s: float | None = None


class AcceptanceRow(Record):
    lane: str
    prompt_class: str
    k: int
    repeats: int
    acceptance_length: float
    acceptance_length_min: float
    acceptance_length_max: float
    verify_steps: float
    accepted: float
    per_position: list[float]
    source: str
    # "chain", or the tree drafted ("tree, topk 4"): there per_position[i] is the share of steps whose
    # accepted path is at least i+1 long (tasks/engines/facts.py DraftPlan).
    draft_shape: str = "chain"
    # What users think acceptance means (tasks/stages/acceptance.py): tokens per target pass, AL
    # without budget-cut draft steps, a bootstrap interval over prompts, enough prompts or not.
    tokens_per_pass: float | None = None
    drafted_share: float | None = None  # decode steps that carried a draft / all decode steps
    acceptance_length_full_steps: float | None = None
    budget_cut_steps: float = 0.0
    prompts: int = 0
    ci_low: float | None = None
    ci_high: float | None = None
    enough_prompts: bool = True
    truncated_share: float = 0.0  # probe requests that ran into the context
    # vLLM's logged `SpecDecoding metrics` over the same window against the pooled 1 + accepted /
    # verify_steps, and their gap (the suite allows at most 0.02).
    acceptance_length_pooled: float | None = None
    draft_tokens: float | None = None  # draft tokens proposed over the windows (counters), where the engine counts them
    engine_logged_acceptance_length: float | None = None
    engine_logged_accepted: int | None = None
    engine_logged_drafted: int | None = None
    engine_log_gap: float | None = None
