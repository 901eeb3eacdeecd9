"""Capacity plan: bytes per seat, from what the server said at boot.

Memory is one budget spent on seats (running requests; on hybrid models a recurrent state each)
and context (the KV pool): 640 state slots left a 201K-token pool, about 4K tokens per user at 48
users; 254 slots gave 56K at 32. For each number of users, the context each gets, from the boot
facts only; a declared concurrency whose typical request does not fit is flagged before warmup.

Pool shapes: llama.cpp gives each slot its own `context_per_slot`; SGLang and vLLM page one shared
pool (`max_total_num_tokens`, `kv_cache_tokens`) that users divide, each capped by the context length.
"""

from __future__ import annotations

from typing import Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from tasks.client.prompts import Prompt
from tasks.correctness.needles import token_counter
from tasks.engines import Engine
from tasks.engines.facts import BootFacts
from tasks.inventory.models import Lane
from tasks.record.table_rows import CapacityRow

_POOL_KEYS = ("max_total_num_tokens", "kv_cache_tokens", "kv_pool_tokens")  # shared paged pools, by engine


class CapacityCheck(BaseModel):
    """The verdict before the curve: does the declared concurrency fit at the typical length?"""

    model_config = ConfigDict(extra="forbid")
    concurrency: int
    typical_tokens: int
    needed_tokens: int
    pool_tokens: int
    context_per_user: int
    fits: bool
    warning: str = ""


def pool(facts: BootFacts, declared_context: int) -> tuple[int, Literal["per-slot", "shared"], int]:
    """(pool tokens, shape, longest context one request may hold) from the boot facts."""
    context = facts.context_per_slot or declared_context
    for key in _POOL_KEYS:
        value = facts.extra.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return int(value), "shared", context
    slots = facts.max_running_requests or 1
    return slots * context, "per-slot", context


def context_per_user(users: int, facts: BootFacts, declared_context: int) -> int:
    tokens, shape, context = pool(facts, declared_context)
    cap = facts.max_running_requests
    if cap is not None and users > cap:
        return 0
    return context if shape == "per-slot" else min(context, tokens // users)


def _state(facts: BootFacts, users: int) -> tuple[int | None, int | None]:
    per = facts.extra.get("mamba_state_slots_per_request")
    have = facts.extra.get("max_mamba_cache_size")
    if isinstance(per, int) and isinstance(have, int):
        return users * per, have
    return None, None


def typical_tokens(lane: Lane, base_url: str, engine: Engine, prompts: list[Prompt]) -> int:
    """The lane's typical request: its declared length, else its longest decode prompt plus decode max_tokens."""
    plan = lane.bench.capacity
    if plan is not None and plan.typical_tokens is not None:
        return plan.typical_tokens
    longest = max(prompts, key=lambda p: len(p.text)).text if prompts else ""
    return token_counter(base_url, engine)(longest) + lane.bench.decode.max_tokens


@task(name="capacity-plan", cache_policy=NO_CACHE)
def capacity_plan(lane_name: str, lane: Lane, facts: BootFacts, typical: int) -> tuple[list[CapacityRow], CapacityCheck]:
    tokens, shape, _ = pool(facts, lane.context)
    cap = facts.max_running_requests
    declared = set(lane.bench.decode.concurrency)
    extra = lane.bench.capacity.users if lane.bench.capacity else []
    users = sorted({1, *declared, *extra, *([cap] if cap else [])})
    kv_bytes = facts.extra.get("kv_cache_bytes")
    rows = []
    for u in users:
        ctx = context_per_user(u, facts, lane.context)
        needed, have = _state(facts, u)
        rows.append(CapacityRow(
            lane=lane_name, users=u, context_per_user=ctx, pool_tokens=tokens, pool_shape=shape, running_cap=cap,
            fits_cap=cap is None or u <= cap, state_slots_needed=needed, state_slots=have,
            kv_bytes_per_seat=float(kv_bytes) / tokens * ctx if isinstance(kv_bytes, int | float) and tokens else None,
            declared=u in declared, typical_tokens=typical, typical_fits=typical <= ctx if ctx else False))
    level = max(lane.bench.decode.gated_levels())
    ctx = context_per_user(level, facts, lane.context)
    needed = level * typical
    fits = typical <= ctx and needed <= tokens
    warning = "" if fits else (
        f"capacity: declared concurrency {level} x typical {typical} tokens (prompt + output) = {needed} tokens "
        f"does not fit the pool of {tokens} tokens ({ctx} tokens per user at {level} users, {shape} pool); "
        "requests will be cut short or queued")
    return rows, CapacityCheck(concurrency=level, typical_tokens=typical, needed_tokens=needed, pool_tokens=tokens,
                               context_per_user=ctx, fits=fits, warning=warning)
