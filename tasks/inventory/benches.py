"""A lane's bench declarations: decode levels (and those past the server's cap), and the optional
prefill ladder, accuracy eval and capacity plan."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tasks.inventory.base import _Strict


class BeyondCap(_Strict):
    """Decode levels run above the server's running-request cap (users ask; the answer is a queue): the
    capacity gate lets exactly these through, labelled "queueing", queue wait apart from TTFT, never
    in a speed verdict."""

    queue: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)]


class PrefillPlan(_Strict):
    """Cold prefill from short to the longest prompt, one warm hit per rung (prompt tokens); a rung the
    context per slot cannot hold with `max_tokens` is skipped with the reason."""

    rungs: Annotated[list[Annotated[int, Field(ge=8)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=64)] = 1
    prompts: str | None = None  # filler text (a prompt set); default: the decode prompts

    @field_validator("rungs")
    @classmethod
    def _sorted(cls, v: list[int]) -> list[int]:
        if v != sorted(set(v)):
            raise ValueError("rungs must be distinct and rising (short to long)")
        return v


class AccuracyPlan(_Strict):
    """A multiple-choice eval (GPQA-Diamond JSONL {question, choices, answer: letter or index}) through
    the chat route. Answers cut at `max_tokens` are re-asked at `reask_max_tokens` and merged back:
    no raw score without the share cut off. `thinking` uses the lane's switch (`default`: none sent)."""

    file: str
    max_tokens: Annotated[int, Field(ge=1)] = 2048
    reask_max_tokens: Annotated[int, Field(ge=1)] = 8192
    limit: Annotated[int, Field(ge=1)] | None = None
    concurrency: Annotated[int, Field(ge=1, le=256)] = 4
    thinking: Literal["default", "on", "off"] = "default"
    stop: list[str] = []
    prompt: str = ("Answer the following multiple choice question. The last line of your response should be "
                   "'Answer: X' where X is the letter of the right choice.\n\n{question}\n\n{choices}")
    confidence: Annotated[float, Field(gt=0.5, lt=1.0)] = 0.95

    @model_validator(mode="after")
    def _caps(self) -> AccuracyPlan:
        if self.reask_max_tokens <= self.max_tokens:
            raise ValueError(f"reask_max_tokens ({self.reask_max_tokens}) must be above max_tokens "
                             f"({self.max_tokens}): the re-ask exists to give capped answers more room")
        if "{question}" not in self.prompt or "{choices}" not in self.prompt:
            raise ValueError("prompt must contain {question} and {choices}")
        return self


class CapacityPlan(_Strict):
    """Bytes per seat: how many users the lane holds at which context. `typical_tokens`: one request's
    prompt plus output (default: the decode prompts by the server's tokenizer plus max_tokens);
    `users`: rows beside the decode levels and the server's cap."""

    typical_tokens: Annotated[int, Field(ge=1)] | None = None
    users: list[Annotated[int, Field(ge=1, le=100_000)]] = []


class DecodePlan(_Strict):
    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)] = [1, 2, 4, 8]
    max_tokens: Annotated[int, Field(ge=1)] = 64
    requests_per_stream: Annotated[int, Field(ge=1)] = 2
    # Measured requests per level over all repeats (a p95 over fewer than 20 is noise): low levels send
    # more per stream, never fewer than requests_per_stream.
    requests_per_level: Annotated[int, Field(ge=1)] | None = None
    prompts: str
    beyond_cap: BeyondCap | None = None  # levels run past the server's cap, labelled "queueing"

    def per_stream(self, concurrency: int, repeats: int) -> int:
        """Requests each stream sends at `concurrency` in one repeat."""
        wanted = -(-(self.requests_per_level or 0) // (concurrency * repeats))  # ceiling division
        return max(self.requests_per_stream, wanted)

    @model_validator(mode="after")
    def _queue_levels_declared(self) -> DecodePlan:
        extra = sorted(set(self.beyond_cap.queue) - set(self.concurrency)) if self.beyond_cap else []
        if extra:
            raise ValueError(f"beyond_cap.queue names levels {extra} that are not in concurrency; "
                             "list them under concurrency too")
        return self

    def queue_levels(self) -> list[int]:
        return sorted(set(self.beyond_cap.queue)) if self.beyond_cap else []

    def gated_levels(self) -> list[int]:
        """The levels the capacity gate judges: every level but the declared queueing ones."""
        queued = set(self.queue_levels())
        return [c for c in self.concurrency if c not in queued] or [1]
    # Load shape (tasks/client/shapes.py): closed loop by default; `rates` sweeps open-loop
    # request rates (req/s) with the largest concurrency level as the in-flight ceiling.
    stagger_s: Annotated[float, Field(ge=0)] = 0.0
    rates: list[Annotated[float, Field(gt=0)]] | None = None
    arrival: Literal["poisson", "constant"] = "poisson"
    deadline_s: Annotated[float, Field(gt=0)] | None = None  # per request, wall clock
    ttft_bound_s: Annotated[float, Field(gt=0)] | None = None  # goodput's bounds
    tpot_bound_s: Annotated[float, Field(gt=0)] | None = None
    # Client processes a wave's load is spread over (tasks/client/workers.py): one asyncio
    # process streams about one core's worth; more only where the host has the cores.
    workers: Annotated[int, Field(ge=1, le=256)] = 1


class AcceptancePlan(_Strict):
    classes: Annotated[dict[str, str], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] = 96
    prompts_per_class: Annotated[int, Field(ge=1)] = 8


class BenchPlan(_Strict):
    repeats: Annotated[int, Field(ge=1, le=50)] = 3
    # Repeats spreading more than this (max - min over median, %) mark a level unstable (tasks/hosts/noise.py).
    unstable_spread_pct: Annotated[float, Field(gt=0)] = 50.0
    decode: DecodePlan
    acceptance: AcceptancePlan | None = None
    prefill: PrefillPlan | None = None
    accuracy: AccuracyPlan | None = None
    capacity: CapacityPlan | None = None
