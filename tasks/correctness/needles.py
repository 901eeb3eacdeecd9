"""The needle ladder: can the lane find what was put in its context, at every size it claims?

Three kinds of needle (one key; five keys; one key among distractors) at each rung, each prompt led
by a fresh nonce, thinking off, greedy. A rung passes when the answer holds the key(s) and none of
the wrong keys; one cut off by max_tokens counts as truncated. Rung sizes are tokens of the user
message by the server's tokenizer (else 4 characters per token).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.client.control import control
from tasks.record.run_folder import RunFolder
from tasks.serving.live import Endpoint
from tasks.client.chat import send_chats
from tasks.inventory.models import Lane, NeedleKind, NeedlePlan
from tasks.engines import Engine, engine_for
from tasks.client.prompts import nonce, with_nonce
from tasks.record.rows import GateResult
from tasks.correctness.thinking import switch_kwargs
from tasks.record.table_rows import NeedleRow, Outcome

TEMPLATE_MARGIN = 48  # tokens a chat template may add around the user message

_PLACES = ["The harbor", "The old library", "A small garden", "The river bank", "The market square",
           "A quiet street", "The museum hall", "The mountain path", "The corner bakery", "A wooden bridge",
           "The train station", "The village well", "The north tower", "A narrow canal"]
_STATES = ["was busy in the morning", "smelled of fresh bread", "stayed calm all afternoon", "had a blue door",
           "was painted last spring", "looked different in the rain", "was full of visitors",
           "closed early on Sundays", "had a tall clock", "was lit by lanterns at night", "needed a new roof",
           "echoed with music", "was cold before dawn", "kept its old name"]
_TAILS = ["", " as usual", " that year", " for a while", " once again"]
_COLORS = ["red", "green", "blue", "yellow", "white"]


class Haystack(BaseModel):
    text: str
    keys: list[str]  # every one must be in the answer
    wrong: list[str]  # none may be (the distractors' keys)
    tokens: int


def default_rungs(context: int, max_tokens: int) -> list[int]:
    """Three rungs: 60%, 80% and all of what a slot leaves after the answer and the template."""
    room = context - max_tokens - TEMPLATE_MARGIN
    return sorted({max(32, 3 * room // 5), max(32, 4 * room // 5), max(32, room)})


def _needles(kind: NeedleKind, rng: random.Random) -> tuple[list[tuple[float, str]], str, list[str], list[str]]:
    """(depth, sentence) needles, the question, the keys to find, the keys that must not appear."""
    keys = [str(k) for k in rng.sample(range(10000, 99999), 5)]
    if kind == "one_key":
        return [(0.5, f"The secret key is {keys[0]}.")], \
            "What is the secret key in the text above? Reply with the number only.", keys[:1], []
    if kind == "five_keys":
        return [(d, f"Key {i + 1} is {k}.") for i, (d, k) in enumerate(zip((0.1, 0.3, 0.5, 0.7, 0.9), keys))], \
            "What are keys 1 to 5? Reply with the five numbers.", keys, []
    depths = (0.2, 0.4, 0.6, 0.8, 0.9)
    return [(d, f"The {c} door key is {k}.") for d, c, k in zip(depths, _COLORS, keys)], \
        "What is the blue door key? Reply with the number only.", [keys[2]], keys[:2] + keys[3:]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_PLACES)} {rng.choice(_STATES)}{rng.choice(_TAILS)}."


def build(kind: NeedleKind, target: int, tag: str, count: Callable[[str], int], seed: int) -> Haystack:
    """The user message for one rung: nonce, filler to just under `target` tokens with the needles at their
    depths, the question; ValueError when the needles and question alone exceed the rung."""
    rng = random.Random(seed)
    needles, question, keys, wrong = _needles(kind, rng)

    def compose(filler: list[str]) -> str:
        body = list(filler)
        for depth, sentence in sorted(needles, reverse=True):
            body.insert(round(depth * len(body)), sentence)
        return with_nonce(" ".join(body) + "\n\n" + question, tag)

    bare = count(compose([]))
    if bare > target:
        raise ValueError(f"the {kind} needles and question alone take {bare} tokens, more than the rung's {target}")
    sample_rng = random.Random(seed + 1)
    per_sentence = count(" ".join(_sentence(sample_rng) for _ in range(40))) / 40
    filler = [_sentence(rng) for _ in range(int((target - bare) / per_sentence))]
    tokens = count(compose(filler))
    for _ in range(8):  # the estimate lands within a few sentences: settle just under the target
        if tokens > target and filler:
            del filler[-max(1, math.ceil((tokens - target) / per_sentence)):]
        elif target - tokens >= per_sentence:
            filler += [_sentence(rng) for _ in range(max(1, int((target - tokens) / per_sentence) - 1))]
        else:
            break
        tokens = count(compose(filler))
    while tokens > target and filler:
        filler.pop()
        tokens = count(compose(filler))
    return Haystack(text=compose(filler), keys=keys, wrong=wrong, tokens=tokens)


def judge(answer: str, keys: list[str], wrong: list[str], finish_reason: str | None) -> tuple[Outcome, int]:
    """pass: every key and no wrong key; truncated: cut off by max_tokens short of that; fail otherwise."""
    numbers = set(re.findall(r"\d+", answer))
    found = sum(1 for k in keys if k in numbers)
    if found == len(keys) and not numbers & set(wrong):
        return "pass", found
    return ("truncated" if finish_reason == "length" else "fail"), found


def token_counter(base_url: str, engine: Engine) -> Callable[[str], int]:
    """Count with the server's tokenizer if the adapter can ask it, else estimate 4 characters per token."""
    try:
        engine.tokenize_request("probe")
    except NotImplementedError:
        return lambda text: max(1, len(text) // 4)

    def count(text: str) -> int:
        spec = engine.tokenize_request(text)
        r = control().post(base_url + spec.path, json=spec.body, timeout=30.0)
        r.raise_for_status()
        return len(engine.parse_tokenize(r.json()))

    return count


def ladder_summary(rows: list[NeedleRow], plan: NeedlePlan) -> GateResult:
    counts = {o: sum(1 for r in rows if r.outcome == o) for o in ("pass", "fail", "truncated", "error")}
    per_kind = "; ".join(
        f"{kind}: " + " ".join(f"{r.target_tokens}={r.outcome}" for r in rows if r.needle_kind == kind)
        for kind in dict.fromkeys(r.needle_kind for r in rows))
    passed = not plan.must_pass or counts["pass"] == len(rows)
    tail = f"every rung must pass: {'passed' if passed else 'failed'}" if plan.must_pass else "report only"
    detail = (f"needle ladder: {counts['pass']}/{len(rows)} rungs passed, {counts['truncated']} truncated, "
              f"{counts['fail']} failed, {counts['error']} errors ({per_kind}); {tail}")
    return GateResult(gate="needles", kind="needles", passed=passed, value=float(counts["pass"]), op=">=",
                      threshold=float(len(rows)) if plan.must_pass else None, detail=detail)


def run_ladder(base_url: str, engine: Engine, lane_name: str, lane: Lane, plan: NeedlePlan) -> list[NeedleRow]:
    """Every kind at every rung, two requests in flight, thinking off through the lane's switch."""
    rungs = plan.rungs or default_rungs(lane.context, plan.max_tokens)
    count = token_counter(base_url, engine)
    kwargs = switch_kwargs(lane.agentic, "off")
    built: list[tuple[NeedleKind, int, int, Haystack | str]] = []
    for kind in plan.kinds:
        for i, target in enumerate(rungs, 1):
            try:
                hay: Haystack | str = build(kind, target, nonce(), count, seed=1000 * i + len(built))
            except ValueError as e:
                hay = str(e)
            built.append((kind, i, target, hay))
    haystacks = [h for *_, h in built if isinstance(h, Haystack)]
    specs = [engine.chat_request([{"role": "user", "content": h.text}], plan.max_tokens, template_kwargs=kwargs)
             for h in haystacks]
    replies = iter(send_chats(base_url, engine, specs, concurrency=2))
    rows = []
    for kind, i, target, hay in built:
        common: dict[str, Any] = {"lane": lane_name, "needle_kind": kind, "rung": i, "target_tokens": target,
                                  "context_per_slot": lane.context}
        if isinstance(hay, str):
            rows.append(NeedleRow(**common, message_tokens=0, prompt_tokens=None, keys_expected=0, keys_found=0,
                                  outcome="error", finish_reason=None, answer=hay, seconds=0.0))
            continue
        reply = next(replies)
        outcome, found = judge(reply.content, hay.keys, hay.wrong, reply.finish_reason) if reply.ok else ("error", 0)
        answer = reply.content if reply.ok else reply.shown()
        rows.append(NeedleRow(**common, message_tokens=hay.tokens, prompt_tokens=reply.prompt_tokens,
                              keys_expected=len(hay.keys), keys_found=found, outcome=outcome,
                              finish_reason=reply.finish_reason, answer=answer[:200], seconds=reply.seconds,
                              started_at=reply.started_at))
    return rows


@task(name="needle-ladder", cache_policy=NO_CACHE)
def needle_ladder(endpoint: Endpoint, run_dir: str, lane: Lane) -> GateResult | None:
    """Run the ladder, write the `needles` table (GX-validated), return the ladder's verdict."""
    plan = lane.correctness.needles if lane.correctness else None
    if plan is None:
        return None
    run, lane_name = RunFolder.opened(run_dir), endpoint.lane
    rows = run_ladder(endpoint.base_url, engine_for(lane.engine), lane_name, lane, plan)
    run.write_table(lane_name, "needles", rows)
    return ladder_summary(rows, plan)
