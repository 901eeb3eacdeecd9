"""A request's wall deadline, derived from its token budget when the lane declares none.

llama-server sends an SSE ping every 30 s, so a read timeout never fires on a stopped server:
every request runs under a wall deadline = TTFT allowance + max_tokens / floor speed (a request
slower than the floor speed is a fault, not a measurement). tasks/stages/deadlines.py derives
wave deadlines from the same numbers.
"""

from __future__ import annotations

import os

TTFT_ALLOWANCE_S = 30.0


def floor_tok_s() -> float:
    """Slowest decode speed that still counts as serving (tokens/s per request); env LANEBENCH_FLOOR_TOK_S."""
    return max(0.01, float(os.environ.get("LANEBENCH_FLOOR_TOK_S", "1.0")))


def request_deadline_s(max_tokens: int) -> float:
    return TTFT_ALLOWANCE_S + max_tokens / floor_tok_s()
