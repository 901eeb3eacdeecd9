"""Prefill ladder: cold prefill speed from short to the longest prompt the lane serves.

Each rung is one prompt of about that many tokens (the server's own tokenizer where it can be
asked), led by a fresh nonce so no prefix cache holds it: TTFT is the cold prefill. The same
prompt is sent again and that warm hit reported apart. A rung past the context per slot is skipped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Literal

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from tasks.client import auth
from tasks.client.prompts import Prompt, nonce, with_nonce
from tasks.correctness.needles import token_counter
from tasks.engines import Engine, engine_for
from tasks.engines.facts import BootFacts
from tasks.inventory.models import PrefillPlan
from tasks.record.progress import progress
from tasks.record.run_folder import RunFolder
from tasks.serving.live import Endpoint
from tasks.record.table_rows import PrefillRow

_TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=60.0)
_BOS_MARGIN = 2  # tokens the server may add around a raw prompt (BOS, a separator)


class PrefillRecord(BaseModel):
    """One prefill request as it happened (kept in `<lane>/prefill.jsonl`)."""

    model_config = ConfigDict(extra="forbid")
    lane: str
    rung: int
    hit: Literal["cold", "warm"]
    nonce: str
    ok: bool
    http_status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    started_at: float
    ttft_s: float | None = None
    e2el_s: float | None = None


def build_prompt(filler: str, target: int, tag: str, count: Callable[[str], int]) -> tuple[str, int]:
    """A nonce-led prompt of at most `target` tokens (as close under as a few trims get it)."""
    if not filler:
        raise ValueError("the prefill filler text is empty")
    per_char = count(filler[:4000]) / len(filler[:4000])

    def of(chars: int) -> tuple[str, int]:
        text = with_nonce((filler * (chars // len(filler) + 2))[:chars], tag)
        return text, count(text)

    chars = int(target / per_char)
    text, tokens = of(chars)
    for _ in range(6):
        if tokens <= target and target - tokens <= max(2, target // 50):
            break
        chars = max(1, chars + int((target - tokens) / per_char) - (1 if tokens > target else 0))
        text, tokens = of(chars)
    while tokens > target and chars > 1:
        chars = max(1, chars - max(1, math.ceil((tokens - target) / per_char)))
        text, tokens = of(chars)
    return text, tokens


def _send(base_url: str, engine: Engine, lane: str, rung: int, hit: Literal["cold", "warm"], tag: str, text: str,
          max_tokens: int) -> PrefillRecord:
    """One streamed request; TTFT is the first streamed chunk. The prompt cache is allowed: the nonce makes the cold hit miss."""
    spec = engine.completion_request(text, max_tokens)
    body = {**spec.body, "cache_prompt": True} if "cache_prompt" in spec.body else spec.body
    started, t0 = time.time(), time.perf_counter()
    ttft = done = status = error = None
    try:
        with httpx.stream("POST", base_url + spec.path, json=body, timeout=_TIMEOUT,
                          headers=auth.headers(base_url)) as resp:
            status = resp.status_code
            if status >= 400:
                error = f"HTTP {status}: {resp.read().decode(errors='replace')[:300]}"
            else:
                for line in resp.iter_lines():
                    event = engine.parse_sse_line(line)
                    if event is None:
                        continue
                    if ttft is None and (event.text or event.tokens or event.done):
                        ttft = time.perf_counter() - t0
                    if event.done and (done is None or event.completion_tokens is not None):
                        done = event
                        if event.completion_tokens is not None:
                            break
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    ok = error is None and done is not None
    return PrefillRecord(lane=lane, rung=rung, hit=hit, nonce=tag, ok=ok, http_status=status,
                         error=error or (None if ok else "stream ended without a final chunk"),
                         prompt_tokens=done.prompt_tokens if done else None,
                         output_tokens=(done.completion_tokens or 0) if done else 0, started_at=started,
                         ttft_s=ttft, e2el_s=time.perf_counter() - t0 if ok else None)


def fits(rung: int, plan: PrefillPlan, facts: BootFacts, declared_context: int) -> tuple[int, str]:
    """The context a slot holds (the server's word, else the lane's) and why a rung does not fit ('' if it does)."""
    context = facts.context_per_slot or declared_context
    room = context - plan.max_tokens - _BOS_MARGIN
    if rung > room:
        source = "the server resolved" if facts.context_per_slot else "the lane declares (the server stated none)"
        return context, (f"rung {rung} tokens + {plan.max_tokens} output does not fit the {context} tokens per slot "
                         f"{source} (at most {room})")
    return context, ""


@task(name="prefill-ladder", cache_policy=NO_CACHE)
def prefill_ladder(endpoint: Endpoint, run_dir: str, plan: PrefillPlan, facts: BootFacts, declared_context: int,
                   filler: list[Prompt]) -> list[PrefillRow]:
    """Rows per rung; each request's raw record goes to the lane's `prefill.jsonl` as it arrives."""
    engine, lane_name, run = engine_for(endpoint.engine), endpoint.lane, RunFolder.opened(run_dir)
    count = token_counter(endpoint.base_url, engine)
    text = "\n\n".join(p.text for p in filler)
    rows = []
    for rung in plan.rungs:
        context, reason = fits(rung, plan, facts, declared_context)
        if reason:
            rows.append(PrefillRow(lane=lane_name, rung=rung, status="skipped", reason=reason, context_per_slot=context))
            continue
        progress(lane_name, f"prefill ladder rung {rung}")
        tag = nonce()
        prompt, _ = build_prompt(text, rung, tag, count)
        cold = _send(endpoint.base_url, engine, lane_name, rung, "cold", tag, prompt, plan.max_tokens)
        run.append_jsonl(lane_name, "prefill.jsonl", cold)
        warm = _send(endpoint.base_url, engine, lane_name, rung, "warm", tag, prompt, plan.max_tokens)
        run.append_jsonl(lane_name, "prefill.jsonl", warm)
        if not (cold.ok and cold.ttft_s and cold.prompt_tokens):
            rows.append(PrefillRow(lane=lane_name, rung=rung, status="failed", context_per_slot=context,
                                   reason=f"cold request failed: {cold.error}"))
            continue
        warm_ttft = warm.ttft_s if warm.ok and warm.ttft_s else None
        rows.append(PrefillRow(
            lane=lane_name, rung=rung, status="measured", context_per_slot=context, prompt_tokens=cold.prompt_tokens,
            cold_ttft_s=cold.ttft_s, prefill_tok_s=cold.prompt_tokens / cold.ttft_s,
            warm_ttft_s=warm_ttft,
            warm_tok_s=cold.prompt_tokens / warm_ttft if warm_ttft else None,
            cache_speedup=cold.ttft_s / warm_ttft if warm_ttft else None,
            reason="" if warm_ttft else f"warm hit failed: {warm.error}"))
    return rows
