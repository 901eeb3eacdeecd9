"""The field's metrics over a level's measured waves (formulas: docs/metrics.md, "Per level").

ITL pools every exactly stamped gap of every request (not a median of medians), each chunk's token
count beside it, so a speculative burst reads as a burst, not as a tiny ITL; throughput counts the
tokens inside each wave's steady window (ramps apart); goodput, the requests within the bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from tasks.wire.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
# The client's aggregate and the one the engine's own timings give may differ by this much (%,
# of the engine's) before a decode level is flagged (issue 23: "within 2 %").
SERVER_AGREE_PCT = 2.0


@overload
def percentile(values: Sequence[float] | np.ndarray, q: float) -> float | None: ...
@overload
def percentile(values: Sequence[float] | np.ndarray, q: float, empty: float) -> float: ...
def percentile(values: Sequence[float] | np.ndarray, q: float, empty: float | None = None) -> float | None:
    """The q-th percentile of `values` (numpy's linear interpolation), `empty` when there are none:
    the one percentile every table of lanebench reports."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else empty


def percentiles(values: Sequence[float]) -> dict[int, float | None]:
    """p50, p90, p95 and p99 (None each when there are no values)."""
    return {q: percentile(values, q) for q in PERCENTILES}


def exact_gaps(r: RequestRecord) -> list[float]:
    """A request's gaps between consecutive chunks with their own stamps: a gap touching a coalesced
    chunk (its read also carried a later event) spans events the client could not tell apart."""
    a, c = r.chunk_arrivals_s, r.chunk_coalesced or [False] * len(r.chunk_arrivals_s)
    return [a[i + 1] - a[i] for i in range(len(a) - 1) if not (c[i] or c[i + 1])]


def pooled_itl(records: list[RequestRecord]) -> list[float]:
    """Every exactly stamped gap between consecutive chunks of every completed request."""
    return [g for r in records if r.ok for g in exact_gaps(r)]


def coalesced_share(records: list[RequestRecord]) -> float | None:
    """Of the completed requests' chunks, the share that shared a read with a later event."""
    chunks = sum(len(r.chunk_coalesced) for r in records if r.ok)
    return sum(sum(r.chunk_coalesced) for r in records if r.ok) / chunks if chunks else None


@dataclass
class Window:
    start_s: float  # from the wave's start
    end_s: float
    wall_s: float
    tokens: int  # tokens that arrived inside the window

    @property
    def steady(self) -> bool:
        return self.end_s > self.start_s

    @property
    def tok_s(self) -> float:
        return self.tokens / (self.end_s - self.start_s) if self.steady else float("nan")

    @property
    def ramp_up_s(self) -> float:
        return self.start_s

    @property
    def ramp_down_s(self) -> float:
        return self.wall_s - self.end_s


def steady_window(records: list[RequestRecord], wall_s: float) -> Window:
    """Closed loop: from the last stream's first send to the first stream's last end (every
    stream busy). Open loop: from the first completion to the last send (arrivals and
    departures both under way). Outside it the server held fewer requests than the shape."""
    timed = [r for r in records if r.sent_s is not None and r.ended_s is not None]
    if not timed:
        return Window(0.0, 0.0, wall_s, 0)
    streams: dict[int, list[RequestRecord]] = {}
    for r in timed:
        if r.stream is not None:
            streams.setdefault(r.stream, []).append(r)
    if streams:
        start = max(min(r.sent_s or 0.0 for r in rs) for rs in streams.values())  # `or`: never None in `timed`
        end = min(max(r.ended_s or 0.0 for r in rs) for rs in streams.values())
    else:
        start = min(r.ended_s or 0.0 for r in timed)
        end = max(r.sent_s or 0.0 for r in timed)
    tokens = 0.0
    for r in timed:
        if not r.ok or not r.chunk_arrivals_s:
            continue
        known = all(n > 0 for n in r.chunk_tokens)
        share = r.output_tokens / len(r.chunk_arrivals_s)
        for i, t in enumerate(r.chunk_arrivals_s):
            if start <= (r.sent_s or 0.0) + t <= end:
                tokens += r.chunk_tokens[i] if known else share
    return Window(float(start), float(end), wall_s, int(round(tokens)))


def server_window_tokens(records: list[RequestRecord], window: Window) -> int | None:
    """The tokens the server's own clock puts inside `window` (None: no request carried timings).

    llama-server's final event carries `timings.predicted_n` tokens generated over `predicted_ms`
    (first token sampled to last). They are spread evenly over that span, ending at the client's
    last chunk stamp, and those inside the window counted. The client's count differs where its
    stamps and the server's durations disagree, or where the server's steps were uneven."""
    tokens, seen = 0, False
    for r in records:
        t = r.server_timings or {}
        n, ms = int(t.get("predicted_n") or 0), t.get("predicted_ms")
        if not r.ok or r.sent_s is None or not r.chunk_arrivals_s or n < 1 or ms is None:
            continue
        seen = True
        end, span = r.sent_s + r.chunk_arrivals_s[-1], ms / 1e3
        step = span / (n - 1) if n > 1 else 0.0
        first = end - span
        if step > 0:  # tokens k with start <= first + k*step <= end
            lo = max(0, math.ceil((window.start_s - first) / step - 1e-9))
            hi = min(n - 1, math.floor((window.end_s - first) / step + 1e-9))
            tokens += max(0, hi - lo + 1)
        elif window.start_s <= end <= window.end_s:
            tokens += n
    return tokens if seen else None


def good(r: RequestRecord, ttft_bound_s: float | None, tpot_bound_s: float | None) -> bool:
    """A request that completed within the declared bounds (an unset bound is not checked)."""
    return (r.ok and (ttft_bound_s is None or (r.ttft_s is not None and r.ttft_s <= ttft_bound_s))
            and (tpot_bound_s is None or r.tpot_s is None or r.tpot_s <= tpot_bound_s))
