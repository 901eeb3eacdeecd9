"""The one retry policy (tenacity) for every step that waits out a transient fault (an SSH
connection, a server's health, a link probe, a webhook, a daemon coming up).

A step says how many tries or how long, which faults are transient (`on`) or which result is
good (`until`), and the waits; a fault not in `on` ends the tries at once. When they run out, the
last fault is raised as it was, or the last result returned for the step to judge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    wait_exponential,
)
from tenacity.retry import retry_base
from tenacity.stop import stop_base

Faults = type[BaseException] | tuple[type[BaseException], ...]


def _last_outcome(state: RetryCallState) -> Any:
    assert state.outcome is not None
    return state.outcome.result()  # the last fault raised again, or the last result


def retrying(*, tries: int | None = None, within_s: float | None = None, wait_s: float, growth: float = 1.0,
             max_wait_s: float = math.inf, on: Faults = (), until: Callable[[Any], bool] | None = None) -> Retrying:
    """Tries of one step: at most `tries`, and none started after `within_s` seconds; the n-th
    wait is `wait_s * growth**(n-1)`, at most `max_wait_s`. Call it with the step and its
    arguments (`retrying(...)(step, *args)`), or iterate it (`for attempt in retrying(...)`)."""
    stop: stop_base = stop_never
    stop |= stop_after_attempt(tries) if tries is not None else stop_never
    stop |= stop_after_delay(within_s) if within_s is not None else stop_never
    retry: retry_base = retry_if_exception_type(on)
    if until is not None:
        retry = retry | retry_if_result(lambda result: not until(result))
    return Retrying(stop=stop, wait=wait_exponential(multiplier=wait_s, exp_base=growth, max=max_wait_s),
                    retry=retry, reraise=True, retry_error_callback=_last_outcome)
