"""A wave's finished requests become records one per loop turn, never in a burst.

At C=64 on an H200 (issue 23) llama-server ends 64 streams in one decode step; building their 64
records (pydantic, the ITL median) and appending each to `requests.jsonl` and its seal (~0.1 ms) took
one 10-20 ms loop turn, twice per wave: the lag probe's p99 hit 2.8-4.8 ms (bound 2 ms), flagging the
level client-bound, and every stream's bytes waited too. So a finished request hands over a builder
(its stamps already taken) and one task builds and keeps them one per loop turn. A thread was tried
first and is worse: it holds the GIL while building (up to the 5 ms switch interval for several).
Records are kept in the order requests ended; a crash loses at most the few not yet built.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from tasks.wire.records import RequestRecord

Builder = Callable[[], RequestRecord]


class Recorder:
    """Build and keep records on the running loop, one per turn; `close` returns them all."""

    def __init__(self, on_record: Callable[[RequestRecord], None] | None) -> None:
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self._pending: deque[Builder] = deque()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    def put(self, build: Builder) -> None:
        """Constant time: no building, no I/O on the caller's turn."""
        self._pending.append(build)
        self._wake.set()

    def _keep(self, build: Builder) -> None:
        record = build()
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                self._keep(self._pending.popleft())
                await asyncio.sleep(0)  # one record a loop turn: the streams' reads come between

    async def close(self) -> list[RequestRecord]:
        """Keep what is pending and return every record; raises what building or keeping raised."""
        self._task.cancel()  # a no-op if it ended by raising: the await then raises that
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        while self._pending:
            self._keep(self._pending.popleft())
        return self.records


__all__ = ["Builder", "Recorder"]
