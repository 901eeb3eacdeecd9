"""Acceptance probe: speculative acceptance per prompt class, over the probe window only.

Only counter deltas over each class's window count (a running average since boot, like SGLang's
avg_spec_accept_length, mixes in warmup and other classes); requests run one at a time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from pydantic import BaseModel

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.engines import engine_for
from tasks.stages.gates import scrape_metrics
from tasks.client.load import Wave, run_wave
from tasks.client.prompts import Prompt
from tasks.engines.facts import Acceptance, LoggedAcceptance
from tasks.record.progress import progress
from tasks.record.rows import AcceptanceRow
from tasks.serving import live
from tasks.serving.live import Endpoint


# Fewer prompts than this per class: the row is kept, but no verdict may rest on it (the seeds'
# drafter moved from 1.96 to 2.59 with the number of probe prompts).
MIN_PROMPTS_FOR_VERDICT = 8


class PromptWindow(BaseModel):
    """One probe request's own counter window (requests run one at a time)."""

    prompt_id: str
    steps: float  # verification steps that carried a draft
    accepted: float
    draft_tokens: float | None
    output_tokens: int
    budget_hit: bool  # ended at max_tokens: its last draft may have been cut by the budget
    context_cut: bool


def overrun(w: PromptWindow) -> float:
    """Accepted draft tokens the counters claim beyond what the request delivered: `output_tokens - 1`
    decoded tokens hold at most `output_tokens - 1 - steps` accepted ones. llama-server shortens its
    last draft to the budget; vLLM drafts K to the end and counts acceptances max_tokens cut off
    (CPU build: about one token per request at max_tokens 96)."""
    return max(0.0, w.accepted - max(w.output_tokens - 1 - w.steps, 0))


def budget_cut(w: PromptWindow, k: int) -> tuple[float, float]:
    """(steps, accepted) of the draft step cut short by the token budget, (0, 0) when none.

    llama-server drafts at most `n_remaining - 1` tokens (server-context.cpp `get_n_draft_max`), so
    the last draft is short and still counts (the target as its own drafter reads 4.70 at K=4, not
    5.00). The shortfall below steps*K is removed as one step that accepted all it drafted; a
    shortfall of K or more has other causes (a draft probability floor) and removes nothing."""
    if w.budget_hit and w.steps >= 1 and overrun(w) > 0:  # vLLM's last step counted past max_tokens
        return 1.0, min(w.accepted, float(k))
    if not w.budget_hit or w.draft_tokens is None or w.steps <= 1:
        return 0.0, 0.0
    deficit = w.steps * k - w.draft_tokens
    if not 0 < deficit < k:
        return 0.0, 0.0
    return 1.0, min(w.accepted, k - deficit)


def _interval(prompts: list[PromptWindow]) -> tuple[float | None, float | None]:
    """95% bootstrap interval of acceptance length over prompts (greedy repeats are identical)."""
    from scipy.stats import bootstrap

    used = [p for p in prompts if p.steps > 0]
    if len(used) < 2:
        return None, None
    accepted = np.array([p.accepted for p in used])
    steps = np.array([p.steps for p in used])
    if np.allclose(accepted / steps, accepted[0] / steps[0]):
        value = 1.0 + accepted.sum() / steps.sum()
        return value, value
    res = bootstrap((accepted, steps), lambda a, s: 1.0 + a.sum() / s.sum(), paired=True, vectorized=False,
                    n_resamples=999, method="percentile", rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def draft_shape(engine_name: str, argv: list[str]) -> str:
    """How the server drafts for the argv it was started with: "chain" or the tree's width."""
    plan = engine_for(engine_name).draft_plan(argv)
    return plan.shape if plan is not None else "chain"


def summarize(lane_name: str, prompt_class: str, k: int, windows: list[Acceptance],
              prompts: list[PromptWindow] | None = None, shape: str = "chain") -> AcceptanceRow:
    """Median over repeats (the per-position median keeps the curve non-increasing); with per-prompt
    windows also tokens per target pass, full-step acceptance and the interval over prompts."""
    lengths = [w.acceptance_length for w in windows]
    width = max(len(w.per_position) for w in windows)
    per_pos = [statistics.median([w.per_position[i] if i < len(w.per_position) else 0.0 for w in windows])
               for i in range(width)]
    extra: dict[str, Any] = {}
    if prompts:
        by_prompt: dict[str, PromptWindow] = {}
        for p in prompts:  # repeats of one prompt pooled: the prompt is the unit of the interval
            q = by_prompt.get(p.prompt_id)
            by_prompt[p.prompt_id] = p if q is None else q.model_copy(update={
                "steps": q.steps + p.steps, "accepted": q.accepted + p.accepted,
                "draft_tokens": None if q.draft_tokens is None or p.draft_tokens is None else q.draft_tokens + p.draft_tokens,
                "output_tokens": q.output_tokens + p.output_tokens})
        decoded = sum(max(p.output_tokens - 1, 0) for p in prompts)  # the first token comes from prefill
        accepted = sum(p.accepted for p in prompts)
        steps = sum(p.steps for p in prompts)
        delivered = accepted - sum(overrun(p) for p in prompts)  # accepted and delivered, not cut by the budget
        passes = decoded - delivered  # one target pass per token not taken from an accepted draft
        cut = [budget_cut(p, k) for p in prompts]
        cut_steps, cut_accepted = sum(c[0] for c in cut), sum(c[1] for c in cut)
        low, high = _interval(list(by_prompt.values()))
        extra = dict(
            tokens_per_pass=decoded / passes if passes > 0 else None,
            drafted_share=steps / passes if passes > 0 else None,
            acceptance_length_full_steps=1.0 + (accepted - cut_accepted) / (steps - cut_steps)
            if steps - cut_steps > 0 else None,
            budget_cut_steps=cut_steps, prompts=len(by_prompt), ci_low=low, ci_high=high,
            enough_prompts=len(by_prompt) >= MIN_PROMPTS_FOR_VERDICT,
            truncated_share=sum(p.context_cut for p in prompts) / len(prompts))
    return AcceptanceRow(
        lane=lane_name, prompt_class=prompt_class, k=k, repeats=len(windows),
        acceptance_length=statistics.median(lengths),
        acceptance_length_min=min(lengths), acceptance_length_max=max(lengths),
        verify_steps=sum(w.verify_steps for w in windows), accepted=sum(w.accepted for w in windows),
        draft_tokens=sum(w.draft_tokens or 0 for w in windows) if all(w.draft_tokens is not None for w in windows) else None,
        per_position=per_pos, source=windows[0].source, draft_shape=shape, **extra,
    )


def _fence(endpoint: Endpoint, interval_s: float | None) -> int | None:
    """The log's length once one log interval (plus slack) has passed; None: the engine logs no acceptance."""
    if interval_s is None:
        return None
    time.sleep(interval_s * 1.2 + 0.3)
    return len(endpoint.log())


def with_logged(row: AcceptanceRow, logged: LoggedAcceptance | None) -> AcceptanceRow:
    """The row beside the engine's own lines over its window: both figures and their gap."""
    pooled = 1.0 + row.accepted / row.verify_steps if row.verify_steps > 0 else None
    if logged is None:
        return row.model_copy(update={"acceptance_length_pooled": pooled})
    gap = abs(pooled - logged.acceptance_length) if pooled is not None else None
    return row.model_copy(update={
        "acceptance_length_pooled": pooled, "engine_logged_acceptance_length": logged.acceptance_length,
        "engine_logged_accepted": logged.accepted, "engine_logged_drafted": logged.drafted, "engine_log_gap": gap})


@task(name="acceptance-probe", cache_policy=NO_CACHE)
def acceptance_probe(endpoint: Endpoint, run_dir: str, k: int, classes: dict[str, list[Prompt]], max_tokens: int,
                     repeats: int, log_interval_s: float | None = None,
                     shape: str = "chain") -> tuple[list[AcceptanceRow], list[str]]:
    """Rows per class, and the classes whose windows held no verification step at all.

    Each request is its own counter window too, so per-prompt figures are exact. With
    `log_interval_s` (the engine logs its own acceptance that often) each class's window is fenced
    by one interval on each side, so the row also carries the engine's figure."""
    engine, lane_name = engine_for(endpoint.engine), endpoint.lane
    scrape = scrape_metrics.fn  # between requests: a plain call, not one task run per request
    keep = live.keeper(run_dir, endpoint)
    rows, silent = [], []
    for prompt_class, prompts in classes.items():
        windows, per_prompt = [], []
        log_from = _fence(endpoint, log_interval_s)
        for repeat in range(1, repeats + 1):
            live.check(endpoint)
            progress(lane_name, f"acceptance {prompt_class} repeat {repeat}/{repeats}")
            wave = Wave(lane=lane_name, stage="acceptance", repeat=repeat, concurrency=1,
                        requests_per_stream=1, max_tokens=max_tokens)
            before = scrape_metrics(endpoint)
            mark, records = before, []
            for prompt in prompts:
                record = run_wave(endpoint.base_url, engine, wave, [prompt], keep).records[0]
                now = scrape(endpoint)
                records.append(record)
                one = engine.acceptance(mark, now, [record], k)
                if record.ok:
                    per_prompt.append(PromptWindow(
                        prompt_id=prompt.id, steps=one.verify_steps if one else 0.0,
                        accepted=one.accepted if one else 0.0, draft_tokens=one.draft_tokens if one else 0.0,
                        output_tokens=record.output_tokens, budget_hit=record.truncation == "max_tokens",
                        context_cut=record.truncation == "context"))
                mark = now
            after = scrape_metrics(endpoint)
            window = engine.acceptance(before, after, records, k)
            if window is not None:
                windows.append(window)
        if windows:
            row = summarize(lane_name, prompt_class, k, windows, per_prompt, shape)
            if log_from is not None:
                _fence(endpoint, log_interval_s)
                row = with_logged(row, engine.logged_acceptance(endpoint.log()[log_from:], k))
            rows.append(row)
        else:
            silent.append(prompt_class)
    return rows, silent
