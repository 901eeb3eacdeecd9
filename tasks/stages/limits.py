"""Distance to the physical limit: a decode-curve row as a share of the memory-bandwidth limit.

At concurrency 1 a dense model's decode reads every weight once per step: the share is model file
bytes x per-user tok/s / bandwidth (the embedding table counted though decode gathers one row; KV
reads left out, so a lower bound). With a drafter a share above 1 is the drafter's gain, not an error.
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
