"""Load shapes: how a wave puts requests in flight.

closed: `concurrency` streams, each sending its next request when the last one ends (the
server always holds `concurrency`); starts may be staggered so that prefills do not batch in
lockstep. open: requests arrive on a schedule (Poisson or constant rate) whatever the server
does, with at most `concurrency` in flight; a request past the ceiling waits, and the wait is
recorded apart (queued_s).
"""

from __future__ import annotations

import random
from itertools import accumulate
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LoadShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["closed", "open"] = "closed"
    concurrency: int = Field(ge=1)  # closed: streams; open: the ceiling on requests in flight
    requests: int = Field(ge=1)  # requests in the wave
    stagger_s: float = Field(default=0.0, ge=0)  # closed: stream i starts at i * stagger_s
    rate: float | None = Field(default=None, gt=0)  # open: requests per second
    arrival: Literal["poisson", "constant"] = "poisson"
    seed: int = 0  # Poisson arrivals are drawn from this seed: a rerun sends the same schedule

    def describe(self) -> str:
        if self.kind == "closed":
            stagger = f", stagger {self.stagger_s:g} s" if self.stagger_s else ""
            return f"closed c={self.concurrency}{stagger}"
        return f"open {self.arrival} {self.rate:g} req/s, ceiling {self.concurrency}"

    def schedule(self) -> list[float]:
        """Send times from the wave's start: open loop only."""
        if self.kind != "open" or self.rate is None:
            raise ValueError("only an open-loop shape with a rate has a schedule")
        if self.arrival == "constant":
            return [i / self.rate for i in range(self.requests)]
        rng = random.Random(self.seed)
        return list(accumulate((rng.expovariate(self.rate) for _ in range(self.requests - 1)), initial=0.0))
