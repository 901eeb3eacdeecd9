"""A request's wall deadline, derived from its token budget when the lane declares none.

llama-server sends an SSE ping every 30 s, so a read timeout never fires on a stopped server:
every request runs under a wall deadline = TTFT allowance + max_tokens / floor speed (a request
slower than the floor speed is a fault, not a measurement). tasks/serving/deadlines.py derives
wave deadlines from the same numbers.
"""

from __future__ import annotations

import os

TTFT_ALLOWANCE_S = 30.0


def request_deadline_s(max_tokens: int) -> float:
    """The floor speed is the slowest decode that still counts as serving (tokens/s per request, env LANEBENCH_FLOOR_TOK_S)."""
    return TTFT_ALLOWANCE_S + max_tokens / max(0.01, float(os.environ.get("LANEBENCH_FLOOR_TOK_S", "1.0")))


STALL_FACTOR = 20.0  # a gap this many times the lane's warm steady ITL p99 is a stall, not a slow token
STALL_FLOOR_S = 10.0  # never below this: a loaded host or a GC pause is not a stall


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def stall_bounds(gaps: list[float], ttfts: list[float]) -> tuple[float, float, float, float] | None:
    """(stall_s, first_token_stall_s, itl_p99_s, ttft_p99_s) from a lane's warm steady waves: the
    gaps between its chunks and its TTFTs. A server that stops mid-curve for a minute passed
    before (issue 27: with no declared `deadline_s` the derived 94 s never fired). None: no gaps."""
    if not gaps:
        return None
    itl = _p99(gaps)
    ttft = _p99(ttfts) if ttfts else itl
    factor = max(2.0, float(os.environ.get("LANEBENCH_STALL_FACTOR", str(STALL_FACTOR))))
    floor = max(0.5, float(os.environ.get("LANEBENCH_STALL_FLOOR_S", str(STALL_FLOOR_S))))
    return max(floor, factor * itl), max(floor, factor * ttft), itl, ttft
