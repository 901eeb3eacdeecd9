"""The rows of the result tables and gate verdicts, in the field's own words
(acceptance length, per-position acceptance, warmup wave)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GateResult(_Record):
    gate: str
    kind: str
    passed: bool
    value: float | None
    op: str
    threshold: float | None
    detail: str


class WarmupRow(_Record):
    lane: str
    concurrency: int
    size_class: str
    first_hit_ttft_s: float
    first_hit_e2el_s: float
    steady_ttft_s: float
    steady_e2el_s: float
    first_hit_cost_s: float  # first-hit e2el minus steady e2el: what a cold bench would have mixed in


class DecodeRow(_Record):
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
    itl_p50_s: float
    requests: int
    failed_requests: int
    # "queueing": a level the lane declared beyond_cap and ran above the server's cap; never judged for speed
    regime: Literal["measured", "queueing"] = "measured"


class AcceptanceRow(_Record):
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


class LaneStatus(_Record):
    lane: str
    status: Literal["passed", "failed", "skipped"]
    reason: str = ""
    stage: str = ""
