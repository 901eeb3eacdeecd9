"""A chat reply as it came back, in the same shape for every engine, and the OpenAI body parser."""

from __future__ import annotations

import json
from typing import Any

from tasks.wire.base import InFlight, Record

_SHOWN = 160  # characters of content or reasoning quoted in a gate's detail


class ToolCall(Record):
    """One structured call as the server returned it; `arguments` is the raw JSON text."""

    name: str
    arguments: str


class ChatReply(Record):
    """One chat request as it came back, in the same shape for every engine."""

    ok: bool
    http_status: int | None = None
    error: str | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = []
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    started_at: float | None = None  # wall clock when it was sent
    seconds: float = 0.0

    def in_flight(self) -> list[InFlight]:
        """This request's time in flight, for the gate that sent it (none if it was never sent)."""
        return [InFlight(started_at=self.started_at, seconds=self.seconds)] if self.started_at else []

    def shown(self) -> str:
        """What came back, quoted short enough for a one-line gate verdict."""
        if not self.ok:
            return f"HTTP {self.http_status}: {(self.error or '')[:_SHOWN]}" if self.http_status else (self.error or "")
        calls = ", ".join(f"{c.name}({c.arguments[:60]})" for c in self.tool_calls)
        parts = [f"finish_reason={self.finish_reason}"] + ([f"tool_calls={calls}"] if calls else [])
        return ", ".join([*parts, f"content={_quote(self.content)}", f"reasoning={_quote(self.reasoning)}"])


def _quote(text: str) -> str:
    return json.dumps(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def parse_openai_chat(data: dict[str, Any]) -> ChatReply:
    """An OpenAI chat completion body -> ChatReply; reasoning is `reasoning_content` (llama.cpp,
    SGLang, older vLLM) or `reasoning` (vLLM since the rename)."""
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = [ToolCall(name=str(fn.get("name") or ""),
                      arguments=a if isinstance(a := fn.get("arguments"), str) else json.dumps(a))
             for fn in (call.get("function") or {} for call in message.get("tool_calls") or [])]
    usage = data.get("usage") or {}
    return ChatReply(ok=True, http_status=200, content=message.get("content") or "",
                     reasoning=message.get("reasoning_content") or message.get("reasoning") or "",
                     tool_calls=calls, finish_reason=choice.get("finish_reason"),
                     prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))
