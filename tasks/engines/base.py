"""The one interface every engine adapter implements.

Stages talk to an `Engine`, never to "llama.cpp" or "SGLang": how to launch, when the
server is healthy, what its boot log says, how to read its counters, and how to turn a
window of counters (or per-request fields) into acceptance in lanebench's single
definition. No stage contains an `if engine == ...`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import ClassVar

from prometheus_client.parser import text_string_to_metric_families

from tasks.config import Lane
from tasks.records import Acceptance, BootFacts, Metrics, RequestRecord, RequestSpec, StreamEvent


class Engine(ABC):
    name: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str] = "/metrics"
    info_path: ClassVar[str | None] = None  # a JSON endpoint describing the resolved server settings

    @abstractmethod
    def launch_command(self, lane: Lane, binary: str, host: str) -> list[str]:
        """argv that starts the server for this lane, listening on host:lane.port."""

    def healthy(self, status_code: int, body: str) -> bool:
        return status_code == 200

    @abstractmethod
    def boot_facts(self, log: str) -> BootFacts:
        """Parse what the server resolved at boot (running-request cap, context, speculation)."""

    def info_facts(self, facts: BootFacts, info: dict) -> BootFacts:
        """Complete the log's boot facts from the info endpoint's JSON (default: nothing to add)."""
        return facts

    def metrics(self, text: str) -> Metrics:
        """Parse Prometheus text exposition into {series: value}; labels sorted into the key."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                if sample.labels:
                    key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}"
                values[key] = float(sample.value)
        return Metrics(values=values)

    @abstractmethod
    def acceptance(self, before: Metrics, after: Metrics, requests: list[RequestRecord], k: int) -> Acceptance | None:
        """Acceptance over the window between two scrapes (and the requests sent in it).

        None when the window holds no verification step at all.
        """

    @abstractmethod
    def completion_request(self, prompt: str, max_tokens: int) -> RequestSpec:
        """A greedy, streamed completion request that does not reuse a cached prompt."""

    @abstractmethod
    def parse_event(self, data: dict) -> StreamEvent:
        """One decoded streaming chunk in the engine's own shape -> StreamEvent."""

    def parse_sse_line(self, line: str) -> StreamEvent | None:
        """Server-sent events: `data: {...}` lines; `data: [DONE]` ends the stream."""
        if not line.startswith("data:"):
            return None
        payload = line[5:].strip()
        if payload == "[DONE]":
            return StreamEvent(done=True)
        return self.parse_event(json.loads(payload))


def per_position_from_counts(accepted_at: list[float], verify_steps: float) -> list[float]:
    """Rates per draft position, one definition for every engine: accepted at k / steps."""
    if verify_steps <= 0:
        return []
    return [a / verify_steps for a in accepted_at]
