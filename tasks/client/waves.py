"""Send waves of streamed requests and keep one raw record per request.

A wave is `concurrency` streams, each sending `requests_per_stream` requests one after
another, so the server holds `concurrency` requests in flight for the whole wave. TTFT is
counted from the first streamed chunk of any kind; ITL from the gaps between chunks.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tasks.engines.base import Engine
from tasks.client.prompts import Prompt, nonce, with_nonce
from tasks.client.records import RequestRecord, truncation_of

_TIMEOUT = httpx.Timeout(connect=10.0, read=120.0, write=30.0, pool=120.0)


@dataclass(frozen=True)
class Wave:
    """One wave's shape and where its records belong."""

    lane: str
    stage: str
    repeat: int
    concurrency: int
    requests_per_stream: int
    max_tokens: int


@dataclass
class WaveResult:
    records: list[RequestRecord]
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records if r.ok)


async def _one_request(client: httpx.AsyncClient, engine: Engine, wave: Wave, prompt: Prompt) -> RequestRecord:
    tag = nonce()
    spec = engine.completion_request(with_nonce(prompt.text, tag), wave.max_tokens)
    started = time.time()
    t0 = time.perf_counter()
    arrivals: list[float] = []
    done = None
    status = None
    error = None
    try:
        async with client.stream("POST", spec.path, json=spec.body) as resp:
            status = resp.status_code
            if resp.status_code >= 400:
                error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in resp.aiter_lines():
                    event = engine.parse_sse_line(line)
                    if event is None:
                        continue
                    if event.text or event.tokens:
                        arrivals.append(time.perf_counter() - t0)
                    if event.done:
                        done = event if done is None or event.completion_tokens is not None else done
                        if event.completion_tokens is not None:
                            break
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    e2el = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    ok = error is None and done is not None
    if error is None and done is None:
        error = "stream ended without a final chunk"
    return RequestRecord(
        lane=wave.lane,
        stage=wave.stage,  # type: ignore[arg-type]
        repeat=wave.repeat,
        concurrency=wave.concurrency,
        prompt_class=prompt.prompt_class,
        prompt_id=prompt.id,
        nonce=tag,
        max_tokens=wave.max_tokens,
        ok=ok,
        http_status=status,
        error=error,
        prompt_tokens=done.prompt_tokens if done else None,
        output_tokens=(done.completion_tokens or 0) if done else 0,
        finish_reason=done.finish_reason if done else None,
        started_at=started,
        ttft_s=arrivals[0] if arrivals else None,
        e2el_s=e2el if ok else None,
        itl_p50_s=statistics.median(gaps) if gaps else None,
        chunks=len(arrivals),
        spec=done.spec if done else None,
        truncation=truncation_of(ok, done.finish_reason if done else None, (done.completion_tokens or 0) if done else 0,
                                 wave.max_tokens, done.truncated if done else None),
    )


async def _run_wave(base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
                    on_record: Callable[[RequestRecord], None] | None) -> WaveResult:
    limits = httpx.Limits(max_connections=wave.concurrency + 2, max_keepalive_connections=wave.concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=_TIMEOUT, limits=limits) as client:

        async def stream(i: int) -> list[RequestRecord]:
            out = []
            for j in range(wave.requests_per_stream):
                prompt = prompts[(i * wave.requests_per_stream + j) % len(prompts)]
                record = await _one_request(client, engine, wave, prompt)
                if on_record:
                    on_record(record)
                out.append(record)
            return out

        t0 = time.perf_counter()
        per_stream = await asyncio.gather(*(stream(i) for i in range(wave.concurrency)))
        wall = time.perf_counter() - t0
    return WaveResult(records=[r for rs in per_stream for r in rs], wall_s=wall)


def run_wave(base_url: str, engine: Engine, wave: Wave, prompts: list[Prompt],
             on_record: Callable[[RequestRecord], None] | None = None) -> WaveResult:
    """Run one wave to completion (blocking); failures are recorded, not raised."""
    if not prompts:
        raise ValueError("a wave needs at least one prompt")
    return asyncio.run(_run_wave(base_url, engine, wave, prompts, on_record))
