"""The strict base every record and row is built on, and a gate request's flight: the bottom of
what the client, the engines and the run folder all speak."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """A row or record: an unknown field is an error, never silently kept."""

    model_config = ConfigDict(extra="forbid")


class InFlight(Record):
    """One request a gate sent: when it left (wall clock) and how long it was in flight."""

    started_at: float
    seconds: float
