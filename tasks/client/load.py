"""Run a wave: in this process (tasks/client/waves.py), or spread over worker processes on one
clock (tasks/client/workers.py) when the wave asks for more than one. Stages call this."""

from __future__ import annotations

from collections.abc import Callable

from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.client.waves import Wave, WaveResult, run_part
from tasks.client.workers import run_spread
from tasks.engines.base import Engine


def run_wave(base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
             on_record: Callable[[RequestRecord], None] | None = None) -> WaveResult:
    """Run one wave to completion (blocking); failures are recorded, not raised."""
    if not prompts:
        raise ValueError("a wave needs at least one prompt")
    if wave.workers > 1:
        return run_spread(base_url, engine, wave, prompts, on_record)
    return run_part(base_url, engine, wave, prompts, on_record)


__all__ = ["Wave", "WaveResult", "run_wave"]
