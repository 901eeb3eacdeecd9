"""Acceptance probe: speculative acceptance per prompt class, over the probe window only.

Counters are scraped right before and right after each class's window and only the
deltas count (a running average since boot, like SGLang's avg_spec_accept_length, would
mix in warmup and every other class). Requests run one at a time so the window holds
nothing else. The engine adapter turns the window into lanebench's one definition.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.stages.boot import Server
from tasks.engines import engine_for
from tasks.stages.gates import scrape_metrics
from tasks.client.waves import Wave, run_wave
from tasks.client.prompts import Prompt
from tasks.client.records import RequestRecord
from tasks.engines.facts import Acceptance
from tasks.record.rows import AcceptanceRow


def summarize(lane_name: str, prompt_class: str, k: int, windows: list[Acceptance]) -> AcceptanceRow:
    """Median over repeats; the per-position median keeps the curve non-increasing."""
    lengths = [w.acceptance_length for w in windows]
    width = max(len(w.per_position) for w in windows)
    per_pos = [statistics.median([w.per_position[i] if i < len(w.per_position) else 0.0 for w in windows])
               for i in range(width)]
    return AcceptanceRow(
        lane=lane_name, prompt_class=prompt_class, k=k, repeats=len(windows),
        acceptance_length=statistics.median(lengths),
        acceptance_length_min=min(lengths), acceptance_length_max=max(lengths),
        verify_steps=sum(w.verify_steps for w in windows), accepted=sum(w.accepted for w in windows),
        per_position=per_pos, source=windows[0].source,
    )


@task(name="acceptance-probe", cache_policy=NO_CACHE)
def acceptance_probe(server: Server, lane_name: str, engine_name: str, k: int, classes: dict[str, list[Prompt]],
                     max_tokens: int, repeats: int, on_record: Callable[[RequestRecord], None],
                     on_progress: Callable[[str], None] = lambda _: None) -> tuple[list[AcceptanceRow], list[str]]:
    """Rows per class, and the classes whose windows held no verification step at all."""
    engine = engine_for(engine_name)
    rows, silent = [], []
    for prompt_class, prompts in classes.items():
        windows = []
        for repeat in range(1, repeats + 1):
            on_progress(f"acceptance {prompt_class} repeat {repeat}/{repeats}")
            wave = Wave(lane=lane_name, stage="acceptance", repeat=repeat, concurrency=1,
                        requests_per_stream=len(prompts), max_tokens=max_tokens)
            before = scrape_metrics(server, engine_name)
            result = run_wave(server.base_url, engine, wave, prompts, on_record)
            after = scrape_metrics(server, engine_name)
            window = engine.acceptance(before, after, result.records, k)
            if window is not None:
                windows.append(window)
        if windows:
            rows.append(summarize(lane_name, prompt_class, k, windows))
        else:
            silent.append(prompt_class)
    return rows, silent
