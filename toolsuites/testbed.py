"""Write the testbed's tool suites: `testbed-dev.jsonl` and `testbed-held-out.jsonl`.

The testbed target learnt eight tools from text like testbed/corpus.py's "tool" class. These
suites ask the same kinds of questions with fresh values, in BFCL's format (simple: one function
offered; multiple: the right one among several), so the rehearsal lane runs the tool gate for
real. The model is tiny and its score low: the plumbing is what is proven. Deterministic:
`python toolsuites/testbed.py` rewrites both files byte for byte.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "testbed"))
import corpus  # noqa: E402  (word lists only)


def _fn(name: str, description: str, props: dict[str, tuple[str, str]], required: list[str]) -> dict:
    return {"name": name, "description": description, "parameters": {
        "type": "dict",
        "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
        "required": required}}


FUNCTIONS = {
    "get_weather": _fn("get_weather", "Current weather in a city.",
                       {"city": ("string", "The city."), "unit": ("string", "celsius or fahrenheit.")},
                       ["city", "unit"]),
    "convert_currency": _fn("convert_currency", "Convert an amount from one currency to another.",
                            {"amount": ("float", "The amount to convert."), "from": ("string", "Currency code."),
                             "to": ("string", "Currency code.")}, ["amount", "from", "to"]),
    "get_stock_price": _fn("get_stock_price", "The current price of a stock.",
                           {"symbol": ("string", "Ticker symbol.")}, ["symbol"]),
    "search_web": _fn("search_web", "Search the web.",
                      {"query": ("string", "What to search for."),
                       "max_results": ("integer", "How many results, default 5.")}, ["query"]),
    "translate": _fn("translate", "Translate a text.",
                     {"text": ("string", "The text."), "target_language": ("string", "Language to translate into.")},
                     ["text", "target_language"]),
    "create_event": _fn("create_event", "Put an event in the calendar.",
                        {"title": ("string", "Event title."), "date": ("string", "YYYY-MM-DD."),
                         "time": ("string", "HH:MM.")}, ["title", "date", "time"]),
    "set_reminder": _fn("set_reminder", "Remind the user of something later.",
                        {"text": ("string", "What to remind of."), "minutes": ("integer", "Minutes from now.")},
                        ["text", "minutes"]),
    "get_time": _fn("get_time", "Local time in a city.", {"city": ("string", "The city.")}, ["city"]),
}


def _question(rng: random.Random, tool: str) -> tuple[str, dict[str, list]]:
    """A request in the phrasing the model learnt, and the acceptable argument values."""
    if tool == "get_weather":
        city, unit = rng.choice(corpus.CITIES), rng.choice(["celsius", "fahrenheit"])
        return f"What's the weather in {city} in {unit}?", {"city": [city], "unit": [unit]}
    if tool == "convert_currency":
        amount = rng.choice([10, 25, 50, 100, 250, 1000, rng.randint(1, 999)])
        src, dst = rng.sample(corpus.CURRENCIES, 2)
        return f"How much is {amount} {src} in {dst}?", {"amount": [amount], "from": [src], "to": [dst]}
    if tool == "get_stock_price":
        sym = rng.choice(corpus.SYMBOLS)
        return f"What is {sym} trading at?", {"symbol": [sym]}
    if tool == "search_web":
        topic, n = rng.choice(corpus.TOPICS), rng.randint(1, 10)
        return f"Find me {n} articles about {topic}.", {"query": [topic], "max_results": [n]}
    if tool == "translate":
        text, lang = f"the {rng.choice(corpus.ADJS)} {rng.choice(corpus.NOUNS)}", rng.choice(corpus.LANGS)
        return f"Translate \"{text}\" into {lang}.", {"text": [text], "target_language": [lang]}
    if tool == "create_event":
        title = f"{rng.choice(corpus.ADJS)} {rng.choice(corpus.NOUNS)} meeting"
        day, hour = rng.choice(corpus.DAYS), f"{rng.randint(8, 18):02d}:{rng.choice(['00', '30'])}"
        return (f"Put a \"{title}\" in my calendar on {day} at {hour}.",
                {"title": [title], "date": [day], "time": [hour]})
    if tool == "set_reminder":
        mins = rng.choice([5, 10, 15, 20, 30, 45, 60, 90])
        what = f"{rng.choice(corpus.VERBS_T)[2]} the {rng.choice(corpus.NOUNS)}"
        return f"Remind me to {what} in {mins} minutes.", {"text": [what], "minutes": [mins]}
    city = rng.choice(corpus.CITIES)
    return f"What time is it in {city}?", {"city": [city]}


def suite(seed: int, prefix: str, per_category: int = 12) -> list[dict]:
    rng = random.Random(seed)
    tools = list(FUNCTIONS)
    cases = []
    for category in ("simple", "multiple"):
        for i in range(per_category):
            tool = tools[i % len(tools)]
            question, answer = _question(rng, tool)
            offered = [tool] if category == "simple" else rng.sample(
                [t for t in tools if t != tool], rng.randint(2, 4)) + [tool]
            rng.shuffle(offered)
            cases.append({"id": f"{prefix}_{category}_{i}", "category": category,
                          "question": [[{"role": "user", "content": question}]],
                          "function": [FUNCTIONS[t] for t in offered],
                          "ground_truth": [{tool: answer}]})
    return cases


def main() -> None:
    for name, seed in (("testbed-dev", 20261), ("testbed-held-out", 90210)):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in suite(seed, name.replace("-", "_"))),
                                            encoding="ascii")


if __name__ == "__main__":
    main()
