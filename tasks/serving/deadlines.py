"""Every stage has a deadline, derived from the lane, and a dead server is named at once.

A hung server (SIGSTOP), a cut link or a stalled worker must fail the lane within a known time
with the stage and the reason, and the other lanes go on. llama-server sends an SSE ping every
30 s, so a read timeout alone never fires on a stopped stream: a request needs a wall deadline.

- request deadline = TTFT allowance + max_tokens / floor speed (a request slower than the floor
  speed is not a measurement, it is a fault);
- wave deadline = requests per stream x request deadline + slack (streams run side by side);
- between waves, the server is checked (`check_alive`; a measuring task calls it itself through
  `check(endpoint)` of tasks/serving/live.py, which holds the lane's server and `Late`): process
  gone, or health not answering within seconds, ends the lane naming what happened, instead of
  sending the remaining waves to a dead server and blaming the next metrics scrape;
- a request that ran past its wall deadline ends the lane at the next check (between waves, and
  after each measuring stage, so a fault in the last wave is caught too), naming the deadline
  and what the check found: a stopped server's health goes silent, but a server hung on a cut
  link or a lost worker still answers its health, so the deadline is the only witness.

The client (tasks/client/waves.py) takes the request deadline; these functions derive it.
"""

from __future__ import annotations

import time

import httpx

from tasks.client.control import control
from tasks.client.deadline import TTFT_ALLOWANCE_S, floor_tok_s, request_deadline_s, stall_bounds  # noqa: F401
from tasks.hosts.transport import TransportError

HEALTH_TIMEOUT_S = 5.0


def wave_deadline_s(requests_per_stream: int, max_tokens: int) -> float:
    return requests_per_stream * request_deadline_s(max_tokens) + 10.0


class ServerDied(RuntimeError):
    """The lane's server is gone or not answering: the lane ends here, with this reason."""


class Late:
    """The lane's requests that ran past their wall deadline or stalled, noted as the records
    arrive (`keep` of tasks/serving/live.py: every judged record a task keeps passes here first).
    Holds the lane's stall bounds once its warmup has measured its steady state."""

    def __init__(self) -> None:
        self.count, self.deadline_s = 0, 0.0
        self.stalls: list[str] = []
        self.stall_s: float | None = None
        self.first_token_stall_s: float | None = None
        self.basis = ""  # how the bounds were derived, in words
        self.server_errors: dict[int, int] = {}  # HTTP 5xx status -> requests that got it
        self.first_server_error = ""

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


def check_alive(server, engine_health_path: str = "/health", late: Late | None = None) -> None:
    """Raise ServerDied when the server's process has exited or its health does not answer in time;
    with `late` holding requests past their deadline, raise in any case, naming the deadline."""
    try:
        _check_alive(server, engine_health_path)
    except ServerDied as e:
        if late is not None and late.any:
            raise ServerDied(f"{late.words()}; {e}") from None
        raise
    if late is not None and late.any:
        if not (late.count or late.stalls):  # only HTTP 5xx: the server answers, and fails requests
            raise ServerDied(f"{late.words()}; its later waves are not sent")
        raise ServerDied(f"{late.words()}, though the server answers its health: hung (a worker or its link "
                         "gone), or too slow for that deadline")


def _check_alive(server, engine_health_path: str) -> None:
    try:  # over SSH, a dropped connection asks the host again: its sshd may be gone
        code = server.process.poll()
        if code is not None:
            raise ServerDied(f"the server died (exit code {code}); last log lines: "
                             + " | ".join(server.log().splitlines()[-3:]))
        for worker in getattr(server, "workers", []):
            if (wcode := worker.poll()) is not None:
                raise ServerDied(f"an RPC worker the server depends on died (exit code {wcode}): "
                                 f"{' '.join(worker.argv[:1])}")
    except TransportError as e:
        raise ServerDied(f"a host of the lane cannot be reached to ask after its processes ({e})") from None
    try:
        r = control().get(server.base_url + engine_health_path, timeout=HEALTH_TIMEOUT_S)
    except httpx.TimeoutException:
        raise ServerDied(f"the server stopped answering (health gave no answer within {HEALTH_TIMEOUT_S:g} s: "
                         "hung, stopped, or its link cut)") from None
    except httpx.TransportError as e:
        for _ in range(20):  # a process that was just killed closes its socket before it is reaped
            if (code := server.process.poll()) is not None:
                raise ServerDied(f"the server died (exit code {code}); last log lines: "
                                 + " | ".join(server.log().splitlines()[-3:])) from None
            time.sleep(0.1)
        raise ServerDied(f"the server is unreachable ({type(e).__name__}) although its process runs") from None
    if r.status_code >= 500 and r.status_code != 503:
        raise ServerDied(f"the server's health says HTTP {r.status_code}")
