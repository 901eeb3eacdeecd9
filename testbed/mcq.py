"""Write the testbed's multiple-choice eval: `testbed/evals/mcq.jsonl` (GPQA-Diamond's record shape).

The testbed target learnt from its training text (corpus.py, class "tool") to turn a request into
a call whose arguments copy it. Each question is such a request with fresh values; the choices are
values of one argument (the unit, or the tool's name), and the reply's call names one. A request
never says which argument is asked: the set measures whether the model copies the right value,
which it does often but not always. Deterministic: `python testbed/mcq.py` rewrites the file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import corpus

HERE = Path(__file__).resolve().parent
SEED = 31_337
QUESTIONS = 12


def _question(rng: random.Random, kind: int) -> tuple[str, list[str], str]:
    """(request, choices, right choice) for one request kind."""
    if kind % 2 == 0:
        city, unit = rng.choice(corpus.CITIES), rng.choice(["celsius", "fahrenheit"])
        ask = rng.choice([f"What's the weather in {city} in {unit}?", f"How warm is it in {city} right now? Use {unit}."])
        return ask, ["celsius", "fahrenheit"], unit
    tool = rng.choice(["get_stock_price", "get_time", "get_weather", "convert_currency"])
    if tool == "get_stock_price":
        ask = f"What is {rng.choice(corpus.SYMBOLS)} trading at?"
    elif tool == "get_time":
        ask = f"What time is it in {rng.choice(corpus.CITIES)}?"
    elif tool == "get_weather":
        ask = f"Is it {rng.choice(corpus.CONDITIONS)} in {rng.choice(corpus.CITIES)} today?"
    else:
        src, dst = rng.sample(corpus.CURRENCIES, 2)
        ask = f"Convert {rng.choice([10, 25, 50, 100])} {src} to {dst}."
    return ask, rng.sample([t for t in corpus.TOOL_NAMES if t != tool], 3) + [tool], tool


def build(n: int = QUESTIONS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, choices, right = _question(rng, i % 4)
        rng.shuffle(choices)
        out.append({"question": question, "choices": choices, "answer": "ABCD"[choices.index(right)]})
    return out


def main() -> None:
    target = HERE / "evals" / "mcq.jsonl"
    target.parent.mkdir(exist_ok=True)
    target.write_text("".join(json.dumps(r) + "\n" for r in build()))
    print(f"wrote {target} ({QUESTIONS} questions)")


if __name__ == "__main__":
    main()
