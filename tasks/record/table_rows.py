"""The rows of the bench, correctness-gate, drafter-matrix and regression tables: below the stages
that fill them, so the kind registry (kinds.py) names only models beneath it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from tasks.wire.base import Record


class PrefillRow(Record):
    """One rung: the cold request's TTFT and prefill speed, the warm hit's beside it."""

    lane: str
    rung: int
    status: Literal["measured", "skipped", "failed"]
    reason: str = ""
    context_per_slot: int
    prompt_tokens: int | None = None
    cold_ttft_s: float | None = None
    prefill_tok_s: float | None = None  # prompt tokens / cold TTFT
    warm_ttft_s: float | None = None
    warm_tok_s: float | None = None  # the same over the warm hit: what the prefix cache makes it look like
    cache_speedup: float | None = None  # cold TTFT / warm TTFT


class CapacityRow(Record):
    """One number of users and the context each can hold."""

    lane: str
    users: int
    context_per_user: int  # tokens each user can hold at once; 0 beyond the running-request cap
    pool_tokens: int
    pool_shape: Literal["per-slot", "shared"]
    running_cap: int | None
    fits_cap: bool
    state_slots_needed: int | None  # hybrid models: recurrent-state slots these users need
    state_slots: int | None  # what the server has
    kv_bytes_per_seat: float | None  # where the server states its KV memory
    declared: bool  # one of the lane's decode levels
    typical_tokens: int | None
    typical_fits: bool | None  # a typical request fits the context each user gets


class QueueRow(Record):
    """One queueing level: the wait before the server took a request, apart from TTFT."""

    lane: str
    concurrency: int
    regime: str = "queueing"
    running_cap: int | None
    beyond_cap: int  # requests in flight above the cap
    requests: int
    ttft_p50_s: float
    ttft_p95_s: float
    served_ttft_p50_s: float  # TTFT p50 at the highest level inside the cap (or the level's quickest)
    queue_wait_p50_s: float
    queue_wait_p95_s: float
    queue_gauge: str  # the engine's metric sampled, '' when it has none
    deferred_peak: float | None
    deferred_mean: float | None


class ToolGateRow(BaseModel):
    """One suite pass: solved/total, misses by kind, seconds, and cost per 1,000 solved."""

    lane: str
    suite: str
    split: Literal["dev", "held_out"]
    suite_sha256: str
    cases: int
    solved: int
    solved_pct: float
    http_error: int
    truncated: int
    no_call: int
    malformed_call: int
    wrong_count: int
    wrong_function: int
    missing_argument: int
    unexpected_argument: int
    wrong_value: int
    accounted: int  # solved + every miss: each case lands in exactly one bucket
    seconds: float
    concurrency: int
    max_tokens: int
    dollars_per_hour: float | None
    cost_per_1000_solved: float | None
    run_number: int  # dev: 1; held_out: how many times these suite bytes have been run, this one included
    # Truncation counted (the seeds' GPQA "truncation score"): cut cases re-asked at REASK_FACTOR x
    # the cap. floor: solved after it, still cut = wrong; finished-and-right: among those that finished.
    truncated_share: float = 0.0
    reask_max_tokens: int | None = None
    floor_pct: float | None = None
    finished_and_right_pct: float | None = None
    truncation_dominated: bool = False  # truncated misses are most of the misses: the score measures the cap


Outcome = Literal["pass", "fail", "truncated", "error"]


class NeedleRow(BaseModel):
    """One rung of one needle kind."""

    lane: str
    needle_kind: str
    rung: int
    target_tokens: int
    message_tokens: int
    prompt_tokens: int | None
    context_per_slot: int
    keys_expected: int
    keys_found: int
    outcome: Outcome
    finish_reason: str | None
    answer: str
    seconds: float
    started_at: float | None = None  # wall clock when it was sent (two rungs run at once)


Measure = Literal["raw", "truncated_share", "floor", "still_truncated_share", "finished_right"]


class AccuracyRow(Record):
    """One of the five measures, with its binomial interval."""

    lane: str
    measure: Measure
    max_tokens: int  # the cap the measure is at
    count: int
    of: int
    value: float | None  # count / of; None when `of` is 0
    ci_low: float | None
    ci_high: float | None
    confidence: float


class ArmClassRow(Record):
    """One arm on one prompt class (kind `matrix_arms`); measurement fields are None for an arm that did not pass."""

    arm: str
    drafter: str
    revision: str
    k: int
    baseline: bool
    status: Literal["passed", "failed", "skipped", "running", "interrupted"]  # the arm lane's own status
    reason: str
    prompt_class: str
    repeats: int | None = None
    acceptance_length: float | None = None
    acceptance_length_min: float | None = None
    acceptance_length_max: float | None = None
    per_position: list[float] | None = None
    draft_shape: str = "chain"  # a tree's per_position[i] is "accepted path at least i+1 long" (AcceptanceRow)
    verify_steps: float | None = None
    accepted: float | None = None
    draft_tokens: float | None = None
    draft_efficiency: float | None = None
    draft_efficiency_min: float | None = None
    draft_efficiency_max: float | None = None
    rejected_per_step: float | None = None  # drafted minus accepted, per verification step: wasted verify work
    single_stream_tok_s: float | None = None
    single_stream_tok_s_min: float | None = None
    single_stream_tok_s_max: float | None = None
    k_plus_1: int  # acceptance length can never exceed K + 1 (checked by the suite)
    curve_nonincreasing: bool | None = None  # per-position rates never rise (checked by the suite)


class VerdictRow(Record):
    """One bar on one arm (kind `matrix_verdict`). pass <=> margin >= 0 (checked by the suite)."""

    bar_index: int
    bar: str  # the bar as registered, in words
    bars_sha256: str
    arm: str
    drafter: str
    k: int
    metric: str
    prompt_class: str | None
    concurrency: int | None
    op: str
    baseline_arm: str | None
    baseline_value: float | None
    threshold: float | None
    measured: float | None
    measured_min: float | None
    measured_max: float | None
    margin: float | None  # how far on the passing side of the bound (negative: failed by that much)
    outcome: Literal["pass", "fail", "no-data"]
    note: str


Verdict = Literal["regression", "suspect", "improvement", "no change", "no baseline", "too few samples",
                  "not comparable"]


class RegressionRow(Record):
    lane: str
    metric: str
    family: str
    better: Literal["higher", "lower"]
    current: float
    baseline: float | None = None  # geometric mean of the baseline runs (mean on the linear scale)
    baseline_min: float | None
    baseline_max: float | None
    baseline_spread_pct: float | None = None  # one standard deviation of the baseline runs, in percent
    band_low: float | None = None  # tonight's value is ordinary noise inside [band_low, band_high] (the t band)
    band_high: float | None = None
    baseline_runs: int
    change_pct: float | None = None  # tonight against the baseline; None: not judged
    ci_low_pct: float | None = None
    ci_high_pct: float | None = None
    min_effect_pct: float
    verdict: Verdict
    baseline_from: str  # baseline run folders, oldest first, comma-separated
