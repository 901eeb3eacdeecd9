"""Typed records that stages hand to each other and write as artifacts.

Field names follow vLLM's `benchmarks/serve.py` result records where one exists
(ttft, itl, e2el, output_tokens), and the field's own words elsewhere
(acceptance length, per-position acceptance, warmup wave).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BootFacts(_Record):
    """What the server itself says about how it booted, read from its log (never from our flags)."""

    max_running_requests: int | None = None
    context_per_slot: int | None = None
    speculative_type: str | None = None
    draft_model_loaded: bool = False
    extra: dict[str, str | int | float | bool] = {}


class Metrics(_Record):
    """One scrape of the server's Prometheus endpoint: series name (with sorted labels) -> value."""

    values: dict[str, float] = {}

    def get(self, name: str, default: float = 0.0) -> float:
        return self.values.get(name, default)

    def total(self, name: str) -> float:
        """A counter summed over all its label sets (vLLM/SGLang label every series)."""
        if "{" in name:
            return self.values.get(name, 0.0)
        return sum(v for k, v in self.values.items() if k == name or k.startswith(name + "{"))


class StreamEvent(_Record):
    """One parsed streaming chunk, in the same shape for every engine."""

    text: str = ""
    tokens: int = 0  # tokens this chunk carries, when the engine says; else 0
    done: bool = False
    completion_tokens: int | None = None  # final count, when the engine reports it
    prompt_tokens: int | None = None
    finish_reason: str | None = None  # "length" | "stop" | engine's own word
    spec: dict[str, float | list[float]] | None = None  # engine-native per-request speculation fields


class RequestSpec(_Record):
    path: str
    body: dict


class RequestRecord(_Record):
    """One request as it happened. Every raw record is kept, warmup and measured alike."""

    lane: str
    stage: Literal["warmup", "decode", "acceptance", "probe"]
    repeat: int  # 0 for warmup; 1..N for measured repeats
    concurrency: int
    prompt_class: str
    prompt_id: str
    nonce: str
    max_tokens: int
    ok: bool
    http_status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    started_at: float  # seconds since the epoch
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_p50_s: float | None = None
    chunks: int = 0
    spec: dict[str, float | list[float]] | None = None


class Acceptance(_Record):
    """Speculative acceptance over one window, in lanebench's single definition.

    acceptance_length = 1 + accepted / verification steps; per_position[k] = drafts
    accepted at position k / verification steps (non-increasing in k).
    """

    verify_steps: float
    accepted: float
    draft_tokens: float | None = None
    acceptance_length: float
    per_position: list[float]
    source: Literal["counters", "requests"]


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
