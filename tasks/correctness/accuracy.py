"""Accuracy eval with truncation accounted for: a multiple-choice set through the lane's chat route.

The seeds' raw GPQA-Diamond score of 64.6% was a truncation score: a third of the answers hit
max_tokens mid-thought. So no raw score without the share cut off: every question is asked at
`max_tokens`, the capped ones re-asked at `reask_max_tokens` and merged back, and five numbers
reported with Wilson intervals: raw, truncated share, floor (after the re-ask, still-capped counted
wrong), still truncated, right when finished. A report, not a gate.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field, field_validator
from scipy.stats import binomtest

from tasks.client.chat import send_chats
from tasks.client.prompts import nonce, with_nonce
from tasks.wire.replies import ChatReply
from tasks.correctness.thinking import switch_kwargs
from tasks.engines import engine_for
from tasks.inventory.models import AccuracyPlan, Lane
from tasks.record.run_folder import RunFolder
from tasks.serving.live import Endpoint
from tasks.record.table_rows import AccuracyRow, Measure

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DOMINANT = 0.5  # a truncated share above this makes the raw score a truncation score
_ANSWER = re.compile(r"(?i:answer)\s*(?i:is)?\s*[:=]?\s*[(\[*]*\s*([A-Z])(?![A-Za-z])")


class McqRecord(BaseModel):
    """One question in the GPQA-Diamond shape; `answer` is the index of the right choice."""

    model_config = ConfigDict(extra="ignore")
    question: str
    choices: list[str] = Field(min_length=2, max_length=26)
    answer: int

    @field_validator("answer", mode="before")
    @classmethod
    def _letter(cls, v: object) -> object:
        if isinstance(v, str) and len(v.strip()) == 1 and v.strip().upper() in LETTERS:
            return LETTERS.index(v.strip().upper())
        return v


def load_mcq(path: Path, limit: int | None = None) -> list[McqRecord]:
    """The eval file; a bad line names file, line and field."""
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = McqRecord.model_validate(json.loads(line))
        except ValueError as e:
            raise ValueError(f"{path}: line {i}: {str(e).splitlines()[0]} (each line: "
                             '{"question": ..., "choices": [...], "answer": "B" or 1})') from None
        if not 0 <= record.answer < len(record.choices):
            raise ValueError(f"{path}: line {i}: answer {record.answer} is not one of the {len(record.choices)} choices")
        records.append(record)
    return records[:limit] if limit else records


class AccuracyAttempt(BaseModel):
    """One question asked once (kept in `<lane>/accuracy.jsonl`)."""

    model_config = ConfigDict(extra="forbid")
    lane: str
    index: int
    attempt: Literal["first", "reask"]
    max_tokens: int
    nonce: str
    ok: bool
    error: str | None = None
    finish_reason: str | None
    truncated: bool
    chosen: str | None  # the letter read from the reply, None when none could be
    answer: str
    right: bool
    completion_tokens: int | None
    prompt_tokens: int | None
    seconds: float
    started_at: float | None = None  # wall clock when it was sent (questions run concurrently)
    reply: str
    reasoning_chars: int


def render(plan: AccuracyPlan, record: McqRecord) -> str:
    choices = "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(record.choices))
    return plan.prompt.replace("{choices}", choices).replace("{question}", record.question)


def extract(content: str, choices: list[str]) -> str | None:
    """The chosen letter: an 'Answer: X' line (the last), a bare letter, or exactly one choice's text."""
    letters = LETTERS[: len(choices)]
    found = [m for m in _ANSWER.findall(content) if m in letters]
    if found:
        return found[-1]
    bare = content.strip().strip("()[]*.: ")
    if len(bare) == 1 and bare in letters:
        return bare
    named = [i for i, c in enumerate(choices) if c.strip() and
             re.search(rf"(?<![\w]){re.escape(c.strip())}(?![\w])", content, re.IGNORECASE)]
    return letters[named[0]] if len(named) == 1 else None


def attempt(lane_name: str, index: int, which: Literal["first", "reask"], cap: int, tag: str, record: McqRecord,
            reply: ChatReply) -> AccuracyAttempt:
    chosen = extract(reply.content, record.choices) if reply.ok else None
    answer = LETTERS[record.answer]
    return AccuracyAttempt(
        lane=lane_name, index=index, attempt=which, max_tokens=cap, nonce=tag, ok=reply.ok,
        error=None if reply.ok else reply.shown(), finish_reason=reply.finish_reason,
        truncated=reply.ok and reply.finish_reason == "length", chosen=chosen, answer=answer, right=chosen == answer,
        completion_tokens=reply.completion_tokens, prompt_tokens=reply.prompt_tokens, seconds=reply.seconds,
        started_at=reply.started_at,
        reply=reply.content[:300], reasoning_chars=len(reply.reasoning))


def measure(lane: str, name: Measure, cap: int, count: int, of: int, confidence: float) -> AccuracyRow:
    ci = binomtest(count, of).proportion_ci(confidence_level=confidence, method="wilson") if of else None
    return AccuracyRow(lane=lane, measure=name, max_tokens=cap, count=count, of=of, value=count / of if of else None,
                       ci_low=float(ci.low) if ci else None, ci_high=float(ci.high) if ci else None, confidence=confidence)


def score(lane: str, plan: AccuracyPlan, first: list[AccuracyAttempt], reasked: dict[int, AccuracyAttempt]) -> list[AccuracyRow]:
    """The five measures from the first pass and the re-asks merged back by question index."""
    n, c = len(first), plan.confidence
    merged = [reasked.get(a.index, a) for a in first]
    finished = [a for a in merged if a.ok and not a.truncated]
    return [
        measure(lane, "raw", plan.max_tokens, sum(a.right for a in first), n, c),
        measure(lane, "truncated_share", plan.max_tokens, sum(a.truncated for a in first), n, c),
        measure(lane, "floor", plan.reask_max_tokens, sum(a.right for a in merged), n, c),
        measure(lane, "still_truncated_share", plan.reask_max_tokens, sum(a.truncated for a in merged), n, c),
        measure(lane, "finished_right", plan.reask_max_tokens, sum(a.right for a in finished), len(finished), c),
    ]


def in_words(rows: list[AccuracyRow]) -> str:
    """The eval in one sentence; the raw score never without its truncated share."""
    by = {r.measure: r for r in rows}
    raw, cut, floor, still, done = (by[m] for m in ("raw", "truncated_share", "floor", "still_truncated_share",
                                                    "finished_right"))

    def pct(r: AccuracyRow) -> str:
        return "n/a" if r.value is None else f"{r.value:.0%} [{r.ci_low:.0%}, {r.ci_high:.0%}]"

    text = (f"raw {raw.count}/{raw.of} = {pct(raw)} at max_tokens {raw.max_tokens}, with {cut.count}/{cut.of} "
            f"= {pct(cut)} of answers cut off at that cap; re-asked at {floor.max_tokens}: floor {pct(floor)}, "
            f"still cut off {pct(still)}, right when finished {done.count}/{done.of} = {pct(done)}")
    if cut.value is not None and cut.value > DOMINANT:
        text = (f"TRUNCATION DOMINATES: {cut.count} of {cut.of} answers hit max_tokens {cut.max_tokens}, so the raw "
                f"score is a truncation score, not the model's: " + text)
    return text


@task(name="accuracy-eval", cache_policy=NO_CACHE)
def accuracy_eval(endpoint: Endpoint, run_dir: str, lane: Lane, path: Path) -> list[AccuracyRow]:
    """Ask, re-ask the capped ones, keep every attempt, write the `accuracy` table (GX-validated)."""
    plan = lane.bench.accuracy
    assert plan is not None
    run, lane_name = RunFolder.opened(run_dir), endpoint.lane
    engine = engine_for(lane.engine)
    records = load_mcq(path, plan.limit)
    kwargs = switch_kwargs(lane.agentic, plan.thinking)
    tags = [nonce() for _ in records]
    texts = [with_nonce(render(plan, r), t) for r, t in zip(records, tags)]

    def ask(indexes: list[int], cap: int) -> list[ChatReply]:
        specs = []
        for i in indexes:
            spec = engine.chat_request([{"role": "user", "content": texts[i]}], cap, template_kwargs=kwargs)
            specs.append(spec.model_copy(update={"body": {**spec.body, "stop": plan.stop}}) if plan.stop else spec)
        return send_chats(endpoint.base_url, engine, specs, concurrency=plan.concurrency)

    first = [attempt(lane_name, i, "first", plan.max_tokens, tags[i], records[i], reply)
             for i, reply in enumerate(ask(list(range(len(records))), plan.max_tokens))]
    capped = [a.index for a in first if a.truncated]
    reasked = {i: attempt(lane_name, i, "reask", plan.reask_max_tokens, tags[i], records[i], reply)
               for i, reply in zip(capped, ask(capped, plan.reask_max_tokens))}
    for a in [*first, *reasked.values()]:
        run.append_jsonl(lane_name, "accuracy.jsonl", a)
    rows = score(lane_name, plan, first, reasked)
    run.write_table(lane_name, "accuracy", rows)
    return rows
