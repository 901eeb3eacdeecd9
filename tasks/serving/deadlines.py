"""A dead or late server is named at once: the lane fails within a known time with the stage
and the reason, and the other lanes go on.

llama-server sends an SSE ping every 30 s, so a read timeout never fires on a stopped stream: each
request runs under a wall deadline (tasks/client/deadline.py). Between waves the server is checked:
process gone or health silent ends the lane, naming it. A request past its deadline ends it at the
next check too: a server hung on a cut link or a lost worker still answers its health.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from tasks.client.control import control
from tasks.client.deadline import stall_bounds
from tasks.hosts.transport import TransportError

HEALTH_TIMEOUT_S = 5.0


class ServerDied(RuntimeError):
    """The lane's server is gone or not answering: the lane ends here, with this reason."""


@dataclass
class Late:
    """The lane's requests that ran past their wall deadline, stalled or got an HTTP 5xx, noted as the
    records arrive; the lane's stall bounds once its warmup has measured its steady state."""

    count: int = 0
    deadline_s: float = 0.0
    stalls: list[str] = field(default_factory=list)
    stall_s: float | None = None
    first_token_stall_s: float | None = None
    basis: str = ""  # how the bounds were derived, in words
    server_errors: dict[int, int] = field(default_factory=dict)  # HTTP 5xx status -> requests that got it
    first_server_error: str = ""

    def set_stall_bounds(self, gaps: list[float], ttfts: list[float]) -> str | None:
        """Bounds from the warm steady waves (tasks/client/deadline.py); returns them in words."""
        bounds = stall_bounds(gaps, ttfts)
        if bounds is None:
            return None
        self.stall_s, self.first_token_stall_s, itl, ttft = bounds
        self.basis = (f"stall bound {self.stall_s:.1f} s mid-stream, {self.first_token_stall_s:.1f} s to the first "
                      f"token (warm steady ITL p99 {itl * 1000:.0f} ms, TTFT p99 {ttft * 1000:.0f} ms)")
        return self.basis

    def note(self, record) -> None:
        if record.error and record.error.startswith("deadline:"):
            self.count += 1
            self.deadline_s = record.deadline_s or 0.0
        elif record.error and record.error.startswith("stall:"):
            self.stalls.append(record.error.removeprefix("stall: "))
        if record.http_status is not None and record.http_status >= 500:  # the server's own failure
            self.server_errors[record.http_status] = self.server_errors.get(record.http_status, 0) + 1
            self.first_server_error = self.first_server_error or (record.error or "")[:200]

    @property
    def any(self) -> bool:
        return bool(self.count or self.stalls or self.server_errors)

    def words(self) -> str:
        parts = []
        if self.server_errors:
            statuses = ", ".join(f"{n} x HTTP {code}" for code, n in sorted(self.server_errors.items()))
            parts.append(f"the server failed requests ({statuses}; first: {self.first_server_error!r})")
        if self.stalls:
            many = f"{len(self.stalls)} requests stalled, the first" if len(self.stalls) > 1 else "a request stalled"
            parts.append(f"{many}: {self.stalls[0]}")
        if self.count:
            many = f"{self.count} requests" if self.count > 1 else "a request"
            parts.append(f"{many} ran past the {self.deadline_s:g} s wall deadline")
        return "; ".join(parts)


def check_alive(server, late: Late | None = None) -> None:
    """ServerDied when the server's process exited or its health is silent; with `late` holding late
    requests, in any case, naming them."""
    try:
        _check_alive(server)
    except ServerDied as e:
        if late is not None and late.any:
            raise ServerDied(f"{late.words()}; {e}") from None
        raise
    if late is not None and late.any:
        if not (late.count or late.stalls):  # only HTTP 5xx: the server answers, and fails requests
            raise ServerDied(f"{late.words()}; its later waves are not sent")
        raise ServerDied(f"{late.words()}, though the server answers its health: hung (a worker or its link "
                         "gone), or too slow for that deadline")


def _check_alive(server) -> None:
    try:  # over SSH, a dropped connection asks the host again: its sshd may be gone
        code = server.process.poll()
        if code is not None:
            raise _died(server, code)
        for worker in getattr(server, "workers", []):
            if (wcode := worker.poll()) is not None:
                raise ServerDied(f"an RPC worker the server depends on died (exit code {wcode}): "
                                 f"{' '.join(worker.argv[:1])}")
    except TransportError as e:
        raise ServerDied(f"a host of the lane cannot be reached to ask after its processes ({e})") from None
    try:
        r = control().get(server.base_url + "/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.TimeoutException:
        raise ServerDied(f"the server stopped answering (health gave no answer within {HEALTH_TIMEOUT_S:g} s: "
                         "hung, stopped, or its link cut)") from None
    except httpx.TransportError as e:
        for _ in range(20):  # a process that was just killed closes its socket before it is reaped
            if (code := server.process.poll()) is not None:
                raise _died(server, code) from None
            time.sleep(0.1)
        raise ServerDied(f"the server is unreachable ({type(e).__name__}) although its process runs") from None
    if r.status_code >= 500 and r.status_code != 503:
        raise ServerDied(f"the server's health says HTTP {r.status_code}")


def _died(server, code: int) -> ServerDied:
    return ServerDied(f"the server died (exit code {code}); last log lines: " + " | ".join(server.log().splitlines()[-3:]))
