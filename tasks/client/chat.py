"""Chat requests for the correctness gates: one OpenAI `/v1/chat/completions` shape for every engine.

The gates ask what an agent client asks, through the OpenAI chat route all three engines serve,
non-streamed, so the server's own tool-call and reasoning parsers shape the answer. A refused or
failed request is a reply with `ok=False` and what came back, never an exception.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx
from tasks.client import auth
from tasks.wire.replies import ChatReply, parse_openai_chat

if TYPE_CHECKING:
    from tasks.engines.base import Engine
    from tasks.wire.records import RequestSpec

_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=300.0)


async def _one(client: httpx.AsyncClient, spec: RequestSpec) -> ChatReply:
    started, t0 = time.time(), time.perf_counter()
    try:
        r = await client.post(spec.path, json=spec.body)
    except httpx.HTTPError as e:
        return ChatReply(ok=False, error=f"{type(e).__name__}: {e}", started_at=started,
                         seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if r.status_code >= 400:
        return ChatReply(ok=False, http_status=r.status_code, error=r.text[:500], started_at=started, seconds=seconds)
    try:
        reply = parse_openai_chat(r.json())
    except (ValueError, KeyError, TypeError) as e:
        return ChatReply(ok=False, http_status=r.status_code, error=f"unreadable reply: {e}: {r.text[:300]}",
                         started_at=started, seconds=seconds)
    return reply.model_copy(update={"started_at": started, "seconds": seconds})


async def _many(base_url: str, specs: Sequence[RequestSpec], concurrency: int) -> list[ChatReply]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=_TIMEOUT, limits=limits,
                                 headers=auth.headers(base_url)) as client:

        async def bounded(spec: RequestSpec) -> ChatReply:
            async with gate:
                return await _one(client, spec)

        return list(await asyncio.gather(*(bounded(s) for s in specs)))


def send_chats(base_url: str, engine: Engine, specs: Sequence[RequestSpec], concurrency: int = 1) -> list[ChatReply]:
    """Send every request, at most `concurrency` in flight; replies in request order. No retries.
    Every engine answers the same OpenAI shape: `engine` is not consulted."""
    return asyncio.run(_many(base_url, specs, max(1, concurrency))) if specs else []
