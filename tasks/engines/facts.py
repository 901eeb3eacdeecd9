"""What a server says about itself: boot facts, a metrics scrape, acceptance over a window."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BootFacts(_Record):
    """What the server itself says about how it booted, read from its log (never from our flags)."""

    max_running_requests: int | None = None
    context_per_slot: int | None = None
    speculative_type: str | None = None
    draft_model_loaded: bool = False
    extra: dict[str, str | int | float | bool] = {}


class Metrics(_Record):
    """One scrape of the server's Prometheus endpoint: series name (with sorted labels) -> value."""

    values: dict[str, float] = {}

    def get(self, name: str, default: float = 0.0) -> float:
        return self.values.get(name, default)

    def total(self, name: str) -> float:
        """A counter summed over all its label sets (vLLM/SGLang label every series)."""
        if "{" in name:
            return self.values.get(name, 0.0)
        return sum(v for k, v in self.values.items() if k == name or k.startswith(name + "{"))


class Acceptance(_Record):
    """Speculative acceptance over one window, in lanebench's single definition.

    acceptance_length = 1 + accepted / verification steps; per_position[k] = drafts
    accepted at position k / verification steps (non-increasing in k).
    """

    verify_steps: float
    accepted: float
    draft_tokens: float | None = None
    acceptance_length: float
    per_position: list[float]
    source: Literal["counters", "requests"]
