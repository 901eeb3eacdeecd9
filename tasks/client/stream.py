"""One stream's events -> what the request did: chunks with their arrival stamps, the final
event, or the one error that makes it THAT request's error row.

Every event comes already stamped (docs/metrics.md); the engine adapter parses its raw bytes
(`Engine.parse_stream_event`): nothing here knows which engine spoke.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tasks.wire.records import StreamEvent
from tasks.engines.base import Engine

# Final usage claiming more than this many times the tokens the chunks carried (plus slack)
# is a broken stream, not a measurement. Applies only where the engine counts each event's
# tokens but keeps no running count: a running count (StreamEvent.tokens_total) is the engine's
# own tally, checked for going backwards instead, since tokens whose bytes the server withheld
# (an incomplete UTF-8 sequence) legitimately leave many tokens in one event.
_INCONSISTENT_RATIO, _INCONSISTENT_SLACK = 2.0, 4


@dataclass
class Outcome:
    error: str | None = None
    final: StreamEvent | None = None
    arrivals: list[float] = field(default_factory=list)  # per chunk, seconds from send
    tokens: list[int] = field(default_factory=list)  # per chunk, as the engine counted (0: unknown)
    coalesced: list[bool] = field(default_factory=list)  # per chunk: its read carried a later event too
    events: int = 0
    output_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    def itl_p50_s(self) -> float | None:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        return statistics.median(gaps) if gaps else None


class Assembler:
    """Parse a stream's events in order, as their bytes arrive. Token-bearing events that arrived
    together (one read, one stamp) are one chunk (a burst): their gap was never
    observable, so it does not enter ITL as a zero."""

    def __init__(self, engine: Engine, t_send: float):
        self.engine, self.t_send = engine, t_send
        self.out = Outcome()
        self._last_t: float | None = None
        self._total: int | None = None  # the engine's running count at the last event that had one

    def feed(self, t: float, raw: bytes, shared: bool = False) -> bool:
        """Take one event (`shared`: its read also carried a later event, http.EventSplitter);
        True when the stream is settled as an error (later events are ignored)."""
        out = self.out
        if out.error is not None:
            return True
        try:
            ev = self.engine.parse_stream_event(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            out.error = f"malformed event ({type(e).__name__}: {str(e)[:160]}): {raw[:200]!r}"
            return True
        if ev is None:
            return False
        out.events += 1
        if ev.error is not None or ev.finish_reason == "error":
            out.error = f"server error event: {ev.error or raw[:300].decode(errors='replace')}"
            return True
        tokens = ev.tokens
        if ev.tokens_total is not None:
            before = self._total or 0
            if ev.tokens_total < before or (ev.tokens_total == before and not ev.done and (ev.text or ev.tokens)):
                out.error = (f"inconsistent stream: the engine's running token count went from {before} to "
                             f"{ev.tokens_total} on an event that carried output")
                return True
            tokens, self._total = ev.tokens_total - before, ev.tokens_total
        self._take(t, shared, ev.text, tokens)
        if ev.done and (out.final is None or (out.final.completion_tokens is None and ev.completion_tokens is not None)):
            out.final = ev  # the first final event, or the first that carries the count
        return False

    def feed_read(self, events: list[tuple[float, bytes, bool]]) -> None:
        """feed() for each event of one read (http.EventSplitter's), the common token events parsed
        together (Engine.stream_tokens) and counted into their chunk here, without a StreamEvent or a
        call an event (the hot path: one event a streamed token, hundreds a read at full speed)."""
        out = self.out
        if out.error is not None or not events:
            return
        try:
            parsed = self.engine.stream_tokens([raw for _, raw, _ in events])
        except (KeyError, TypeError, AttributeError):  # JSON of another shape somewhere in the read
            parsed = None
        if parsed is None:
            parsed = [self._one_token(raw) for _, raw, _ in events]
        # _take inlined, with its last stamp in a local: a call an event cost 7 % of the CPU a token
        # (alternating runs on the 2-core VM, 2026-12-08); feed() still goes through _take.
        arrivals, tokens, coalesced, t_send = out.arrivals, out.tokens, out.coalesced, self.t_send
        last_t = self._last_t
        for (t, raw, shared), token in zip(events, parsed):
            if token is None:
                self._last_t = last_t
                if self.feed(t, raw, shared):
                    return
                last_t = self._last_t
                continue
            out.events += 1
            text, n = token
            if text or n:
                if t == last_t:
                    tokens[-1] += n
                else:
                    arrivals.append(t - t_send)
                    tokens.append(n)
                    coalesced.append(shared)
                    last_t = t
        self._last_t = last_t

    def _one_token(self, raw: bytes) -> tuple[str, int] | None:
        try:
            return self.engine.stream_token(raw)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # feed() says what is wrong with it

    def _take(self, t: float, shared: bool, text: str, tokens: int) -> None:
        """A token-bearing event's place in the chunks: a new chunk, or more of the one that
        arrived with it (same read, same stamp)."""
        if text or tokens:
            out = self.out
            if t == self._last_t:
                out.tokens[-1] += tokens
            else:
                out.arrivals.append(t - self.t_send)
                out.tokens.append(tokens)
                out.coalesced.append(shared)
                self._last_t = t

    def finish(self) -> Outcome:
        out = self.out
        if out.error is not None:
            return out
        if out.final is None:
            out.error = "stream ended without a final event" if out.events else "empty stream: no event at all"
            return out
        if not out.arrivals:
            out.error = "empty stream: the final event came with no token-bearing event before it"
            return out
        carried = sum(out.tokens)
        known = all(n > 0 for n in out.tokens)
        claimed = out.final.completion_tokens
        if claimed is not None and self._total is not None and claimed != self._total:
            out.error = f"inconsistent stream: final usage claims {claimed} tokens, the engine's running count is {self._total}"
            return out
        if claimed is not None and known and self._total is None \
                and claimed > _INCONSISTENT_RATIO * carried + _INCONSISTENT_SLACK:
            out.error = f"inconsistent stream: final usage claims {claimed} tokens, the chunks carried {carried}"
            return out
        out.output_tokens = claimed if claimed is not None else (carried if known else len(out.arrivals))
        return out
