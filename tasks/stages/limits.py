"""Distance to the physical limit: a decode-curve row as a share of the memory-bandwidth limit.

At concurrency 1 a dense model's decode is bound by memory: each step reads every weight once,
so the fastest one stream can go is bandwidth / bytes read per step. The share is
(bytes read per step x steps per second) / bandwidth, with bytes per step taken as the model
file's size (the weights; a few header bytes too many, and the token-embedding table counted
though decode gathers one row of it: for the testbed's byte-level vocabulary a rounding error)
and steps per second as the row's per-user tok/s. KV-cache reads are left out, so the share is
a lower bound on what the hardware was asked for. With a drafter one step can yield several
tokens: a share above 1 is then the drafter's gain, not an error.
"""

from __future__ import annotations

import math

from tasks.record.rows import DecodeRow


def bandwidth_share(per_user_tok_s: float, model_bytes: int, memory_gbps: float) -> float:
    """Model bytes read per second at this speed over the memory bandwidth (GB/s, 10^9 bytes)."""
    return per_user_tok_s * model_bytes / (memory_gbps * 1e9)


def with_bandwidth_share(rows: list[DecodeRow], model_bytes: int | None, memory_gbps: float | None) -> list[DecodeRow]:
    """The rows, the concurrency-1 ones priced against the bandwidth when the host declares it."""
    if not model_bytes or not memory_gbps:
        return rows
    return [r.model_copy(update={"bandwidth_share": bandwidth_share(r.per_user_tok_s, model_bytes, memory_gbps)})
            if r.concurrency == 1 and math.isfinite(r.per_user_tok_s) else r for r in rows]
