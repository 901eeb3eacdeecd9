"""Agentic smoke gate: the booted server serves the workload the lane declares, not just text.

Without `--tool-call-parser` and `--reasoning-parser` a server aced every throughput bench while
agents broke silently (tool calls as text, chain-of-thought in replies). So `agentic.tools` must
yield structured `tool_calls`, `agentic.reasoning` reasoning apart from the content; either failure
fails the boot, quoting what came back.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.serving.live import Endpoint
from tasks.client.chat import send_chats
from tasks.wire.replies import ChatReply
from tasks.inventory.models import Lane
from tasks.engines import engine_for
from tasks.wire.records import RequestSpec
from tasks.record.rows import GateResult
from tasks.correctness.thinking import switch_kwargs

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    }, "required": ["city", "unit"]},
}}
TOOL_QUESTION = "What's the weather in Paris in celsius?"
REASONING_QUESTION = "What is 17 times 3? Think it through, then answer."
TOOL_MAX_TOKENS = 256  # a whole call, even from a byte-level testbed model (one token per character)
REASONING_MAX_TOKENS = 96  # reasoning only has to start
_THINK_TAGS = ("<think>", "</think>")


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False


def judge_tool_calls(reply: ChatReply) -> GateResult:
    """Pass when at least one structured call with a name and JSON-object arguments came back."""
    good = [c for c in reply.tool_calls if c.name and _is_object(c.arguments)]
    if good:
        detail = "a tool request came back as structured tool_calls: " + ", ".join(
            f"{c.name}({c.arguments[:80]})" for c in good)
    elif not reply.ok:
        detail = f"the tool request failed: {reply.shown()}"
    elif reply.tool_calls:
        detail = f"tool_calls came back with arguments that are not a JSON object: {reply.shown()}"
    else:
        detail = ("a tool request came back as text, not as tool_calls (no tool-call parser, or a chat "
                  f"template without tools?): {reply.shown()}")
    return GateResult(gate="smoke:tool-calls", kind="smoke", passed=bool(good), value=float(len(good)),
                      op=">=", threshold=1.0, detail=detail, requests=reply.in_flight())


def judge_reasoning(reply: ChatReply) -> GateResult:
    """Pass when reasoning came back in its own field and no thinking markup is left in the content."""
    leaked = [t for t in _THINK_TAGS if t in reply.content]
    passed = reply.ok and bool(reply.reasoning.strip()) and not leaked
    if passed:
        detail = f"reasoning came back apart from the content ({len(reply.reasoning)} characters)"
    elif not reply.ok:
        detail = f"the reasoning request failed: {reply.shown()}"
    elif leaked:
        detail = f"thinking markup {leaked[0]} leaked into the content (no reasoning parser?): {reply.shown()}"
    else:
        detail = ("no reasoning came back apart from the content (no reasoning parser, or thinking off?): "
                  f"{reply.shown()}")
    return GateResult(gate="smoke:reasoning", kind="smoke", passed=passed, value=1.0 if passed else 0.0,
                      op="==", threshold=1.0, detail=detail, requests=reply.in_flight())


@task(name="agentic-smoke", cache_policy=NO_CACHE)
def smoke_gate(endpoint: Endpoint, lane: Lane) -> list[GateResult]:
    """The checks the lane's declarations call for: tool calls with thinking off, reasoning with it on."""
    agentic = lane.agentic
    if agentic is None or not (agentic.tools or agentic.reasoning):
        return []
    engine = engine_for(lane.engine)
    checks: list[tuple[RequestSpec, Callable[[ChatReply], GateResult]]] = []
    if agentic.tools:
        checks.append((engine.chat_request([{"role": "user", "content": TOOL_QUESTION}], TOOL_MAX_TOKENS,
                                           tools=[WEATHER_TOOL], tool_choice="auto",
                                           template_kwargs=switch_kwargs(agentic, "off")), judge_tool_calls))
    if agentic.reasoning:
        checks.append((engine.chat_request([{"role": "user", "content": REASONING_QUESTION}], REASONING_MAX_TOKENS,
                                           template_kwargs=switch_kwargs(agentic, "on")), judge_reasoning))
    replies = send_chats(endpoint.base_url, engine, [spec for spec, _ in checks], concurrency=len(checks))
    return [judge(reply) for (_, judge), reply in zip(checks, replies)]
