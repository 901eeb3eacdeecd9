"""One request as the client saw it: the request, each stream event, the raw record.

Field names follow vLLM's `benchmarks/serve.py` result records (ttft, itl, e2el, output_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tasks.wire.base import Record


@dataclass(slots=True)
class StreamEvent:
    """One parsed streaming chunk, in the same shape for every engine.

    A slots dataclass, not a Record: one is built per streamed event on the client's hot path,
    where pydantic's validation cost a fifth of the CPU a token. The types are still checked, so
    an event of the wrong shape fails as a malformed event (TypeError)."""

    text: str = ""
    tokens: int = 0  # tokens this chunk carries, when the engine says; else 0
    # The engine's own running count of generated tokens at this event (llama.cpp's
    # `tokens_predicted`); when set, the event's tokens are its step from the previous count,
    # which also counts tokens whose bytes the server withheld (an incomplete UTF-8 sequence).
    tokens_total: int | None = None
    done: bool = False
    completion_tokens: int | None = None  # final count, when the engine reports it
    prompt_tokens: int | None = None
    finish_reason: str | None = None  # "length" | "stop" | engine's own word
    spec: dict[str, float | list[float]] | None = None  # engine-native per-request speculation fields
    truncated: bool | None = None  # the server says it cut or shifted the context (llama.cpp `truncated`)
    # The server's own clock for this request, as it reported it in the final event (llama.cpp
    # `timings`: predicted_n, predicted_ms, prompt_n, prompt_ms, ...): numbers only.
    timings: dict[str, float] | None = None
    error: str | None = None  # the server's own words when the event is an error event

    def __post_init__(self) -> None:
        if type(self.text) is not str or type(self.tokens) is not int or type(self.done) is not bool:
            raise TypeError(f"stream event of the wrong shape: {self!r}")
        for name, kind in _OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"stream event field {name} is {value!r}, not {kind.__name__}")


_OPTIONAL_FIELDS = (("tokens_total", int), ("completion_tokens", int), ("prompt_tokens", int), ("finish_reason", str),
                    ("spec", dict), ("truncated", bool), ("timings", dict), ("error", str))


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


class RequestSpec(Record):
    path: str
    body: dict


class RequestRecord(Record):
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
    ttft_s: float | None = None  # send -> first byte of the first token-bearing event (connect apart)
    e2el_s: float | None = None  # send -> last byte of the stream
    itl_p50_s: float | None = None  # median of this request's gaps between chunks
    chunks: int = 0  # token-bearing chunks: events that reached the client in one read count once
    spec: dict[str, float | list[float]] | None = None
    # The server's own timings of this request (llama.cpp's final `timings`: predicted_n,
    # predicted_ms, prompt_n, prompt_ms, ...), kept raw so the client's clocks can be checked
    # against the engine's (decode rows' server_tok_s, docs/metrics.md)
    server_timings: dict[str, float] | None = None
    truncation: Truncation | None = None  # none | max_tokens | context (truncation_of); None: failed
    # The clocks behind the numbers above (docs/metrics.md); times in seconds.
    tpot_s: float | None = None  # (e2el - ttft) / (output_tokens - 1)
    stream: int | None = None  # closed loop: which of the wave's streams sent it
    sent_s: float | None = None  # send time from the wave's start (perf_counter clock)
    ended_s: float | None = None  # when the request ended (completed or failed), from the wave's start
    scheduled_s: float | None = None  # open loop: when the schedule said to send, from the wave's start
    queued_s: float = 0.0  # waiting for a connection under the concurrency ceiling
    connect_s: float | None = None  # TCP connect time; None when the request reused a connection
    reused_connection: bool = False
    chunk_arrivals_s: list[float] = []  # each chunk's first byte, from send (its read's kernel stamp)
    chunk_tokens: list[int] = []  # tokens each chunk carried (a speculative burst shows as > 1)
    # per chunk: its read also carried a later event, so its stamp is that read's last bytes'
    # arrival, an upper bound for this chunk (docs/metrics.md, "Coalesced reads")
    chunk_coalesced: list[bool] = []
    events: int = 0  # server-sent events received, pings and the final event included
    deadline_s: float | None = None  # the wall deadline this request ran under
