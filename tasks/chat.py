"""Chat requests for the correctness gates: one OpenAI `/v1/chat/completions` shape for every engine.

The speed stages talk to each engine's native streaming route; the correctness gates ask what an
agent client asks, through the OpenAI chat route all three engines serve, non-streamed, so the
server's own tool-call and reasoning parsers shape the answer. A refused or failed request is a
reply with `ok=False` and what came back, never an exception: a gate judges it and names it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from tasks.engines.base import Engine
    from tasks.records import RequestSpec

_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=300.0)
_SHOWN = 160  # characters of content or reasoning quoted in a gate's detail


class ToolCall(BaseModel):
    """One structured call as the server returned it; `arguments` is the raw JSON text."""

    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ChatReply(BaseModel):
    """One chat request as it came back, in the same shape for every engine."""

    model_config = ConfigDict(extra="forbid")
    ok: bool
    http_status: int | None = None
    error: str | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = []
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    seconds: float = 0.0

    def shown(self) -> str:
        """What came back, quoted short enough for a one-line gate verdict."""
        if not self.ok:
            return f"HTTP {self.http_status}: {(self.error or '')[:_SHOWN]}" if self.http_status else (self.error or "")
        parts = [f"finish_reason={self.finish_reason}"]
        if self.tool_calls:
            parts.append("tool_calls=" + ", ".join(f"{c.name}({c.arguments[:60]})" for c in self.tool_calls))
        parts.append(f"content={_quote(self.content)}")
        parts.append(f"reasoning={_quote(self.reasoning)}")
        return ", ".join(parts)


def _quote(text: str) -> str:
    return json.dumps(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def parse_openai_chat(data: dict[str, Any]) -> ChatReply:
    """An OpenAI chat completion body -> ChatReply.

    Reasoning arrives as `reasoning_content` (llama.cpp, SGLang, older vLLM) or `reasoning`
    (vLLM since the field was renamed); both are read.
    """
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        calls.append(ToolCall(name=str(fn.get("name") or ""),
                              arguments=args if isinstance(args, str) else json.dumps(args)))
    usage = data.get("usage") or {}
    return ChatReply(
        ok=True,
        http_status=200,
        content=message.get("content") or "",
        reasoning=message.get("reasoning_content") or message.get("reasoning") or "",
        tool_calls=calls,
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )


async def _one(client: httpx.AsyncClient, engine: Engine, spec: RequestSpec) -> ChatReply:
    t0 = time.perf_counter()
    try:
        r = await client.post(spec.path, json=spec.body)
    except httpx.HTTPError as e:
        return ChatReply(ok=False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if r.status_code >= 400:
        return ChatReply(ok=False, http_status=r.status_code, error=r.text[:500], seconds=seconds)
    try:
        reply = engine.parse_chat(r.json())
    except (ValueError, KeyError, TypeError) as e:
        return ChatReply(ok=False, http_status=r.status_code, error=f"unreadable reply: {e}: {r.text[:300]}",
                         seconds=seconds)
    return reply.model_copy(update={"seconds": seconds})


async def _many(base_url: str, engine: Engine, specs: Sequence[RequestSpec], concurrency: int) -> list[ChatReply]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=_TIMEOUT, limits=limits) as client:

        async def bounded(spec: RequestSpec) -> ChatReply:
            async with gate:
                return await _one(client, engine, spec)

        return list(await asyncio.gather(*(bounded(s) for s in specs)))


def send_chats(base_url: str, engine: Engine, specs: Sequence[RequestSpec], concurrency: int = 1) -> list[ChatReply]:
    """Send every request, at most `concurrency` in flight; replies in request order. No retries."""
    if not specs:
        return []
    return asyncio.run(_many(base_url, engine, specs, max(1, concurrency)))


def send_chat(base_url: str, engine: Engine, spec: RequestSpec) -> ChatReply:
    return send_chats(base_url, engine, [spec])[0]
