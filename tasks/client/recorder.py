"""A wave's finished requests become records one per loop turn, never in a burst.

Building 64 records and appending them to `requests.jsonl` in the turn 64 streams ended in held the
loop 10-20 ms (issue 23; docs/benchmarks.md, "Why the flag fired"). So a finished request hands
over a builder (its stamps already taken) and one task builds and keeps them, one a turn (a thread
is worse: it holds the GIL while building). Records are kept in the order requests ended; a crash
loses at most the few not yet built.
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
