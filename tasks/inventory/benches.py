"""A lane's further bench declarations: the prefill ladder, the accuracy eval, the capacity plan,
and the decode levels it runs past the server's cap (`beyond_cap`). Each is optional: a lane
that declares none runs as before."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tasks.inventory.base import _Strict


class BeyondCap(_Strict):
    """Decode levels the lane runs even above the server's running-request cap.

    Users ask what happens past the cap; the answer is a queue, not speed. Those levels run
    (the capacity gate lets exactly them through), are labelled "queueing" in every table and
    plot, report queue wait apart from TTFT, and never feed a speed verdict.
    """

    queue: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)]


class PrefillPlan(_Strict):
    """Cold prefill from short to the longest prompt the lane serves, one warm hit per rung.

    `rungs` are prompt sizes in tokens; a rung the server's context per slot cannot hold (with
    `max_tokens` of output) is skipped with the reason, not sent.
    """

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
    """A multiple-choice eval in the GPQA-Diamond record shape, through the lane's chat route.

    `file` is JSONL of {question, choices, answer} (answer: a letter or the index of the right
    choice). Answers that hit `max_tokens` are re-asked at `reask_max_tokens` and merged back by
    question index: the raw score is never shown without the share that was cut off.
    `prompt` renders one record ({question} and {choices}); `thinking` picks the regime through
    the lane's declared switch (`default`: what a client gets without asking).
    """

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
    """Bytes per seat: how many users the lane holds at which context each.

    `typical_tokens` is one request's prompt plus output as the lane's users send it (default:
    the decode prompts counted by the server's tokenizer plus the decode max_tokens); `users`
    adds rows to the table beside the decode levels and the server's cap.
    """

    typical_tokens: Annotated[int, Field(ge=1)] | None = None
    users: list[Annotated[int, Field(ge=1, le=100_000)]] = []


class DecodePlan(_Strict):
    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)] = [1, 2, 4, 8]
    max_tokens: Annotated[int, Field(ge=1)] = 64
    requests_per_stream: Annotated[int, Field(ge=1)] = 2
    # At least this many measured requests per level, over all repeats: a p95 over fewer than 20
    # is one request's noise (the regression check reads it "too few samples"). Low levels then
    # send more requests per stream; a level never sends fewer than requests_per_stream.
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
    # A decode level whose repeats spread more than this (max - min over median, %) is marked
    # unstable: noise, not a baseline (tasks/hosts/noise.py says why 50).
    unstable_spread_pct: Annotated[float, Field(gt=0)] = 50.0
    decode: DecodePlan
    acceptance: AcceptancePlan | None = None
    prefill: PrefillPlan | None = None
    accuracy: AccuracyPlan | None = None
    capacity: CapacityPlan | None = None
