"""A wave's finished requests become records one per loop turn, never in a burst.

Why: at C=64 on an H200 (issue 23) llama-server ends 64 streams in the same decode step, and the
loop then built 64 records (pydantic validation, the per-request ITL median) and handed each to
`on_record`, which appends it to `requests.jsonl` and its seal (five file system calls, ~0.1 ms):
one loop turn of 10-20 ms, twice per wave, while the client used a third of a core. The loop's
lag probe saw it (p99 2.8-4.8 ms against a 2 ms bound) and flagged the level client-bound, and
every stream's bytes waiting on that turn waited too.

Here a finished request only hands over a builder (a closure over what it measured, its stamps
already taken) and the next request goes out at once; one task builds and keeps the records,
one per loop turn, so the streams' reads and the lag probe come between any two. A thread was
tried first and is worse: it holds the GIL while it builds, and the loop then waits for it (up
to the 5 ms switch interval when it builds several in a row).

Records are still kept as each request ends (a crash loses at most the few not yet built), in
the order the requests ended; `close` keeps the rest and raises what building or keeping raised.
"""

from __future__ import annotations

import asyncio
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
        """Keep what is still pending (the wave's clocks are read by then) and return every record;
        what building or keeping raised is raised here."""
        if self._task.done():
            self._task.result()  # raises what the task raised
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        while self._pending:
            self._keep(self._pending.popleft())
        return self.records


__all__ = ["Builder", "Recorder"]
