"""One request as the client saw it: the request, each stream event, the raw record.

Field names follow vLLM's `benchmarks/serve.py` result records (ttft, itl, e2el, output_tokens).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamEvent(_Record):
    """One parsed streaming chunk, in the same shape for every engine."""

    text: str = ""
    tokens: int = 0  # tokens this chunk carries, when the engine says; else 0
    done: bool = False
    completion_tokens: int | None = None  # final count, when the engine reports it
    prompt_tokens: int | None = None
    finish_reason: str | None = None  # "length" | "stop" | engine's own word
    spec: dict[str, float | list[float]] | None = None  # engine-native per-request speculation fields
    truncated: bool | None = None  # the server says it cut or shifted the context (llama.cpp `truncated`)


Truncation = Literal["none", "max_tokens", "context"]


def truncation_of(ok: bool, finish_reason: str | None, output_tokens: int, max_tokens: int,
                  context_cut: bool | None) -> Truncation | None:
    """How a request ended: finished on its own, hit max_tokens, or ran into the context
    (the server's own flag, or stopped for length short of max_tokens). None: it failed."""
    if not ok:
        return None
    if context_cut or (finish_reason == "length" and output_tokens < max_tokens):
        return "context"
    if finish_reason == "length" or output_tokens >= max_tokens:
        return "max_tokens"
    return "none"


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
    truncation: Truncation | None = None  # none | max_tokens | context (truncation_of); None: failed
