"""Thinking switch check: does the lane's declared switch actually change the regime?

One chat template honours `enable_thinking` and ignores `reasoning_effort`, another the reverse:
the wrong switch silently gives the wrong regime. Each declared switch gets the same prompt twice,
"on" and "off", and passes only when reasoning comes back with "on" and none with "off".
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.serving.live import Endpoint
from tasks.client.chat import send_chats
from tasks.wire.replies import ChatReply
from tasks.inventory.models import Agentic, Lane, ThinkingSwitch
from tasks.engines import engine_for
from tasks.client.prompts import nonce, with_nonce
from tasks.record.rows import GateResult

PROMPT = "Is 91 a prime number? Answer yes or no."
MAX_TOKENS = 48  # enough for reasoning to start; the check needs presence, not a finished thought


def switch_kwargs(agentic: Agentic | None, regime: Literal["on", "off", "default"]) -> dict[str, Any] | None:
    """Chat-template kwargs that put the lane in `regime` through its first switch; None: the server's default."""
    if agentic is None or not agentic.thinking_switch or regime == "default":
        return None
    switch = agentic.thinking_switch[0]
    return {switch.name: switch.on if regime == "on" else switch.off}


def judge_switch(switch: ThinkingSwitch, on: ChatReply, off: ChatReply) -> GateResult:
    """Pass when reasoning comes back with the switch on and none with it off."""
    name = switch.name
    on_set, off_set = f"{name}={switch.on!r}", f"{name}={switch.off!r}"
    if not on.ok or not off.ok:
        bad = on if not on.ok else off
        detail = f"thinking switch {name}: the request with {on_set if bad is on else off_set} failed: {bad.shown()}"
        passed = False
    else:
        thinks_on, thinks_off = bool(on.reasoning.strip()), bool(off.reasoning.strip())
        passed = thinks_on and not thinks_off
        if passed:
            detail = (f"thinking switch {name} works: {on_set} -> {len(on.reasoning)} characters of reasoning, "
                      f"{off_set} -> none")
        elif thinks_on and thinks_off:
            detail = (f"thinking switch {name} is ignored: reasoning came back with {on_set} and with {off_set} "
                      f"(off: {off.shown()})")
        elif not thinks_on and not thinks_off:
            detail = (f"thinking switch {name} is ignored: no reasoning with {on_set} or with {off_set} "
                      f"(on: {on.shown()})")
        else:
            detail = f"thinking switch {name} works backwards: reasoning with {off_set}, none with {on_set}"
    return GateResult(gate=f"thinking:{name}", kind="thinking", passed=passed, value=1.0 if passed else 0.0,
                      op="==", threshold=1.0, detail=detail, requests=[*on.in_flight(), *off.in_flight()])


@task(name="thinking-check", cache_policy=NO_CACHE)
def thinking_check(endpoint: Endpoint, lane: Lane) -> list[GateResult]:
    """One verdict per declared switch; the on and off requests share one prompt and nonce."""
    if lane.agentic is None:
        return []
    engine = engine_for(lane.engine)
    results = []
    for switch in lane.agentic.thinking_switch:
        messages = [{"role": "user", "content": with_nonce(PROMPT, nonce())}]
        on, off = send_chats(endpoint.base_url, engine, [
            engine.chat_request(messages, MAX_TOKENS, template_kwargs={switch.name: switch.on}),
            engine.chat_request(messages, MAX_TOKENS, template_kwargs={switch.name: switch.off}),
        ], concurrency=2)
        results.append(judge_switch(switch, on, off))
    return results
