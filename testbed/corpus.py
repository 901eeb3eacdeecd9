"""Deterministic synthetic text for the lanebench testbed models (classes: README.md, "Files").

Generated, not downloaded: the rehearsal lane rebuilds its models offline, bit for bit. A seeded
``random.Random`` drives small grammars for four classes whose predictability differs on purpose
(prose free, code forced by structure, math fixed scaffolding with hard digits, tool calls that
copy the request), so speculative decoding shows different acceptance per class. All text is
ASCII. ``python testbed/corpus.py`` writes the held-out ``prompts/<class>.jsonl``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import partial
from pathlib import Path

CLASSES: tuple[str, ...] = ("prose", "code", "math", "tool")
# Control-token strings that may appear in the text; the tokenizer maps each to one id.
TEXT_SPECIALS: tuple[str, ...] = ("<tool_call>", "</tool_call>")
TRAIN_SEED = 1234
PROMPT_SEED = 987_654
PROMPTS_PER_CLASS = 16
PROMPT_MIN_BYTES = 150
PROMPT_MAX_BYTES = 400
BYTES_PER_CLASS = 3_000_000  # training text per class, as build_models.py uses it
HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- word lists

NAMES_F = """Anna Maria Clara Elena Nora Lucy Ruth Irene Vera Julia Alice Hannah Mira Sofia Greta
             Ada Lena Rosa Tessa Edith Helen Ivy Olga Paula Wendy Zoe""".split()
NAMES_M = """Tom Peter Hugo Oscar Felix Victor Arthur Simon Daniel Martin Leo Jonas Bruno Carl Elias
             Frank Ivan Karl Louis Milo Noah Otto Paul Ralph Samuel Walter""".split()
NOUNS = """lamp door river garden letter window basket candle bridge coat map key bottle chair table
           book clock bell cart boat stone feather ribbon mirror blanket bucket ladder rope wagon
           kettle pencil drawer curtain violin lantern shovel hammer needle jacket helmet saddle
           anchor barrel blossom cabinet compass cottage crystal dragon engine fence flag forest
           fountain gate glove hill horse island jar kitten lake meadow mountain notebook orchard
           parcel pebble piano pillow pocket puzzle rabbit road roof sail scarf shell shadow signal
           song spoon star storm street tower trumpet tunnel valley village wall wheel whistle wolf
           yard apple cloud cup field plate ring ship tree""".split()
ADJS = """old small quiet bright heavy strange golden broken narrow gentle cold warm silver dusty
          empty hidden wooden tall soft dark pale rusty green blue red ancient careful clever
          curious distant early faint fragile friendly gray grand hollow humble late lonely loud
          lucky modest muddy noble plain polite proud rare rough round sharp shiny silent simple
          slow smooth steady sudden sweet swift tiny tired wide wild windy wise yellow young bitter
          brave calm crooked damp eager fierce gloomy hungry icy merry""".split()
VERBS_T = [tuple(v.split("/")) for v in """
    found/found/find carried/carried/carry opened/opened/open painted/painted/paint
    watched/watched/watch lifted/lifted/lift dropped/dropped/drop followed/followed/follow
    repaired/repaired/repair hid/hidden/hide counted/counted/count cleaned/cleaned/clean
    sold/sold/sell bought/bought/buy borrowed/borrowed/borrow broke/broken/break carved/carved/carve
    chased/chased/chase covered/covered/cover examined/examined/examine fixed/fixed/fix
    gathered/gathered/gather held/held/hold kept/kept/keep measured/measured/measure
    moved/moved/move noticed/noticed/notice pulled/pulled/pull pushed/pushed/push
    raised/raised/raise remembered/remembered/remember studied/studied/study touched/touched/touch
    traded/traded/trade wrapped/wrapped/wrap stole/stolen/steal took/taken/take saw/seen/see
    built/built/build forgot/forgotten/forget shook/shaken/shake threw/thrown/throw drew/drawn/draw
    tied/tied/tie polished/polished/polish guarded/guarded/guard weighed/weighed/weigh
""".split()]
VERBS_I = ["waited", "laughed", "slept", "wandered", "listened", "smiled", "sighed",
           "hesitated", "returned", "whispered", "worked", "rested", "paused", "shivered",
           "sang", "danced", "left", "arrived", "stayed", "walked", "ran", "nodded",
           "frowned", "wept", "shouted", "stumbled", "knelt", "climbed", "listened closely",
           "looked away", "turned around", "sat down", "stood up", "went home"]
ADVS = ["slowly", "quickly", "quietly", "carefully", "gladly", "suddenly", "softly",
        "boldly", "calmly", "eagerly", "gently", "kindly", "loudly", "nervously", "patiently",
        "proudly", "rarely", "sadly", "silently", "warmly", "wisely", "again", "at once",
        "without a word", "for a long time", "once more", "in silence", "with care"]
PLACES = """kitchen harbor market library station garden attic cellar chapel school square bakery
            forest meadow shore hallway workshop courtyard orchard barn mill tower inn museum bridge
            cliff valley village castle cabin farm lighthouse theater stable pier tavern quarry
            greenhouse""".split()
PREPS = "near behind inside beside under above across outside beyond around toward past".split()
TIMES = ["In the morning", "At noon", "That evening", "Late at night", "Before dawn",
         "After lunch", "On Sunday", "In the spring", "Last winter", "The next day",
         "Years later", "Soon after", "At midnight", "By the afternoon", "Once",
         "Every autumn", "That summer", "Long ago"]
TIMEWORDS = "morning evening night day week season winter summer afternoon hour year spring".split()
SUBSTANCES = ["bread", "smoke", "rain", "salt", "pine", "honey", "dust", "iron", "soap",
              "apples", "tea", "coffee", "wax", "roses", "oil", "snow", "mint", "ink"]
NUMWORDS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "a dozen", "many", "several", "a few", "twenty"]
SAID = ["said", "asked", "whispered", "replied", "shouted", "muttered", "called", "added"]
FEELINGS = "happy afraid tired angry hopeful sad proud lost calm restless curious glad".split()

# --------------------------------------------------------------------------- prose


def _plural(noun: str) -> str:
    """Naive English plural; good enough for the word lists above."""
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun == "wolf":
        return "wolves"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _quote(rng: random.Random) -> str:
    """A short line of dialogue."""
    n, a = rng.choice(NOUNS), rng.choice(ADJS)
    forms = [
        f"Where is the {n}?",
        f"I think the {n} is {a}.",
        f"{rng.choice(VERBS_T)[2].capitalize()} the {n}!",
        f"We should go to the {rng.choice(PLACES)}.",
        f"Have you seen my {a} {n}?",
        f"The {n} was never {a}.",
        f"I am {rng.choice(FEELINGS)} today.",
        f"Do not {rng.choice(VERBS_T)[2]} the {a} {n}.",
    ]
    return rng.choice(forms)


class _Fresh:
    """Draws words not yet used in the current paragraph: a small model's greedy decoding loops
    ("The barn smelled of salt and soap. The barn smelled of ...") unless its text never repeats."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def __call__(self, words: list[str]) -> str:
        for _ in range(30):
            w = self.rng.choice(words)
            if w not in self.used:
                break
        self.used.add(w)
        return w

    def verb(self) -> tuple[str, str, str]:
        base = self([v[2] for v in VERBS_T])
        return next(v for v in VERBS_T if v[2] == base)


def _prose_templates(rng: random.Random, fresh: _Fresh, cast: list[tuple[str, str]],
                     place: str) -> list[Callable[[], str]]:
    """Sentence templates; each draws its words lazily from ``fresh``."""
    (a, pa), (b, pb) = rng.sample(cast, 2)
    n, adj, vt = partial(fresh, NOUNS), partial(fresh, ADJS), fresh.verb
    vi, adv, prep = partial(fresh, VERBS_I), partial(fresh, ADVS), partial(rng.choice, PREPS)

    def pl() -> str:
        return rng.choice([place, place, fresh(PLACES)])

    return [
        lambda: f"{a} {vt()[0]} the {adj()} {n()} {prep()} the {pl()}.",
        lambda: f"The {n()} was {adj()}, and {a} {vi()} {adv()}.",
        lambda: f"{rng.choice(TIMES)}, {a} and {b} {vi()} {prep()} the {pl()}.",
        lambda: f"\"{_quote(rng)}\" {rng.choice(SAID)} {a}.",
        lambda: f"It was a {adj()} {rng.choice(TIMEWORDS)}, and the {_plural(n())} {vi()} "
                f"{adv()}.",
        lambda: f"{a} thought about the {n()} that {pa} had {vt()[1]} {prep()} the {pl()}.",
        lambda: f"Nobody knew why the {n()} was so {adj()}.",
        lambda: f"{a} {vt()[0]} {rng.choice(NUMWORDS)} {_plural(n())} and gave them to {b}.",
        lambda: f"When the {n()} {vi()}, {a} {vt()[0]} the {n()} {adv()}.",
        lambda: f"The {pl()} smelled of {fresh(SUBSTANCES)} and {fresh(SUBSTANCES)}.",
        lambda: f"{a} asked {b} whether the {n()} was {adj()} or {adj()}.",
        lambda: f"After a while, {a} {vi()} again.",
        lambda: f"{b} did not answer; {pb} {vt()[0]} the {n()} {adv()} instead.",
        lambda: f"There were {rng.choice(NUMWORDS)} {adj()} {_plural(n())} {prep()} the "
                f"{pl()}.",
        lambda: f"{a} wanted to {vt()[2]} the {n()} before the {rng.choice(TIMEWORDS)} ended.",
        lambda: f"{a} felt {rng.choice(FEELINGS)}, because the {n()} had been {vt()[1]}.",
        lambda: f"Somewhere {prep()} the {pl()}, a {adj()} {n()} {vi()}.",
        lambda: f"{b} {vt()[0]} the {n()}, and {a} {vt()[0]} the {n()}.",
        lambda: f"The {adj()} {n()} belonged to {b}, or so {a} said.",
        lambda: f"{a} {vi()} until the {n()} was {adj()} again.",
    ]


N_PROSE_TEMPLATES = 20
_order = list(range(N_PROSE_TEMPLATES))
random.Random(5).shuffle(_order)
# Which template usually follows which: one fixed 20-cycle through all templates.
PROSE_NEXT: dict[int, int] = {_order[i]: _order[(i + 1) % N_PROSE_TEMPLATES]
                              for i in range(N_PROSE_TEMPLATES)}


def _prose_paragraph(rng: random.Random, cast: list[tuple[str, str]], place: str) -> str:
    """3-7 sentences; no template and no content word is used twice.

    With i.i.d. sentences greedy decoding repeats the single most likely one. Here the next
    sentence usually (75%) uses the successor of the last one's template, a signal a small model
    learns, so greedy output walks the 20-cycle instead.
    """
    fresh = _Fresh(rng)
    used: list[int] = []
    for _ in range(rng.randint(3, 7)):
        nxt = PROSE_NEXT[used[-1]] if used else -1
        if nxt < 0 or nxt in used or rng.random() >= 0.75:
            nxt = rng.choice([t for t in range(N_PROSE_TEMPLATES) if t not in used])
        used.append(nxt)
    # Fresh templates per sentence, so who acts (``a``/``b``) varies within the paragraph.
    return " ".join(_prose_templates(rng, fresh, cast, place)[t]() for t in used)


def gen_prose(rng: random.Random) -> str:
    """A short story: a title and paragraphs about a small fixed cast."""
    names = rng.sample(NAMES_F, 2) + rng.sample(NAMES_M, 2)
    cast = [(nm, "she" if nm in NAMES_F else "he") for nm in rng.sample(names, 3)]
    place = rng.choice(PLACES)
    title = f"The {rng.choice(ADJS).capitalize()} {rng.choice(NOUNS).capitalize()}"
    paras = [_prose_paragraph(rng, cast, place) for _ in range(rng.randint(2, 4))]
    return title + "\n\n" + "\n\n".join(paras) + "\n"


# --------------------------------------------------------------------------- code

CODE_VERBS = """compute load parse build update find merge filter count check render format collect
                normalize validate split scale encode decode sort read write apply resolve group
                select reset clean export import""".split()
CODE_NOUNS = """total items records config user order price score buffer path name value token
                matrix event message node entry result weight batch window record label index count
                report cache queue table column row amount limit offset size width height delay
                rate""".split()
CODE_CLASSES = """Order User Account Invoice Sensor Vector Point Matrix Task Job Queue Cache Window
                  Report Record Message Event Node Graph Session Client Server Parser Buffer Counter
                  Timer Ledger Basket Route""".split()
CODE_OPS = ["+", "-", "*"]


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(CODE_VERBS)}_{rng.choice(CODE_NOUNS)}"


def _code_function(rng: random.Random) -> str:
    """One function from a template; names are drawn so bodies echo the signature."""
    verb, noun = rng.choice(CODE_VERBS), rng.choice(CODE_NOUNS)
    a, b = rng.sample(CODE_NOUNS, 2)
    item = rng.choice(["item", "x", "elem", "entry", "value", "row", "part"])
    op = rng.choice(CODE_OPS)
    k, m = rng.randint(2, 99), rng.randint(2, 9)
    attr = rng.choice(CODE_NOUNS)
    t = rng.randrange(8)
    if t == 0:
        return (f"def {verb}_{noun}({a}, {b}):\n"
                f"    \"\"\"{verb.capitalize()} the {noun} from {a} and {b}.\"\"\"\n"
                f"    result = {rng.choice(['0', '1', '0.0'])}\n"
                f"    for {item} in {a}:\n"
                f"        result {op}= {item} * {b}\n"
                f"    return result\n")
    if t == 1:
        return (f"def {verb}_{noun}({a}, threshold={k}):\n"
                f"    \"\"\"Return the {noun} entries of {a} above threshold.\"\"\"\n"
                f"    selected = []\n"
                f"    for {item} in {a}:\n"
                f"        if {item}.{attr} > threshold:\n"
                f"            selected.append({item})\n"
                f"    return selected\n")
    if t == 2:
        return (f"def {verb}_{noun}_map({a}):\n"
                f"    {noun}_map = {{}}\n"
                f"    for key, value in {a}.items():\n"
                f"        {noun}_map[key] = value {op} {k}\n"
                f"    return {noun}_map\n")
    if t == 3:
        return (f"def {verb}_{noun}({a}):\n"
                f"    return [{item} {op} {k} for {item} in {a} if {item} % {m} == 0]\n")
    if t == 4:
        meth = rng.choice(["strip", "lower", "upper", "splitlines", "split"])
        return (f"def {verb}_{noun}(path):\n"
                f"    try:\n"
                f"        with open(path) as handle:\n"
                f"            return handle.read().{meth}()\n"
                f"    except OSError as error:\n"
                f"        print(\"could not {verb} {noun}:\", error)\n"
                f"        return None\n")
    if t == 5:
        return (f"def {verb}_{noun}({a}, {b}={k}):\n"
                f"    if not {a}:\n"
                f"        raise ValueError(\"{a} must not be empty\")\n"
                f"    {noun} = len({a}) {op} {b}\n"
                f"    if {noun} > {k * m}:\n"
                f"        {noun} = {k * m}\n"
                f"    return {noun}\n")
    if t == 6:
        return (f"def {verb}_{noun}({a}, {b}):\n"
                f"    index = 0\n"
                f"    while index < len({a}):\n"
                f"        if {a}[index] == {b}:\n"
                f"            return index\n"
                f"        index += 1\n"
                f"    return -1\n")
    return (f"def {verb}_{noun}({a}):\n"
            f"    counts = {{}}\n"
            f"    for {item} in {a}:\n"
            f"        counts[{item}] = counts.get({item}, 0) + 1\n"
            f"    return sorted(counts.items(), key=lambda pair: pair[1], reverse=True)\n")


def _code_class(rng: random.Random) -> str:
    """A small class whose methods reuse its constructor's fields."""
    cls = rng.choice(CODE_CLASSES)
    f1, f2, f3 = rng.sample(CODE_NOUNS, 3)
    op = rng.choice(CODE_OPS)
    default = rng.choice(["None", "0", "1", "[]", "\"\"", str(rng.randint(2, 99))])
    method = _ident(rng)
    return (f"class {cls}:\n"
            f"    \"\"\"A {rng.choice(ADJS)} {cls.lower()} with {f1}, {f2} and {f3}.\"\"\"\n"
            f"\n"
            f"    def __init__(self, {f1}, {f2}, {f3}={default}):\n"
            f"        self.{f1} = {f1}\n"
            f"        self.{f2} = {f2}\n"
            f"        self.{f3} = {f3}\n"
            f"\n"
            f"    def {method}(self):\n"
            f"        return self.{f1} {op} self.{f2}\n"
            f"\n"
            f"    def __repr__(self):\n"
            f"        return f\"{cls}({f1}={{self.{f1}}}, {f2}={{self.{f2}}})\"\n")


def gen_code(rng: random.Random) -> str:
    """A Python-like module: imports, a few functions or classes, maybe a main guard."""
    imports = rng.sample(["import os", "import sys", "import json", "import math",
                          "from typing import Dict, List", "import re"], rng.randint(1, 3))
    parts = ["\n".join(sorted(imports)) + "\n"]
    names: list[str] = []
    for _ in range(rng.randint(2, 4)):
        block = _code_class(rng) if rng.random() < 0.3 else _code_function(rng)
        if block.startswith("def "):
            names.append(block[4:block.index("(")])
        parts.append(block)
    if names and rng.random() < 0.6:
        arg = rng.choice(["[1, 2, 3]", "sys.argv[1:]", "{}", "\"data.txt\"", "range(10)"])
        parts.append(f"if __name__ == \"__main__\":\n    print({rng.choice(names)}({arg}))\n")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- math

OBJECTS = ["apples", "coins", "books", "marbles", "stamps", "pencils", "cards", "eggs",
           "shells", "tickets", "stickers", "cookies", "bottles", "boxes", "flowers"]


def _math_steps(rng: random.Random, start: int, n_steps: int) -> tuple[list[str], int]:
    """A chain of operations; each step's result is the next step's left operand."""
    lines, cur = [], start
    for i in range(1, n_steps + 1):
        op = rng.choice(["+", "-", "*"] if cur <= 50 else ["+", "-"])
        x = rng.randint(2, 99) if op == "+" else rng.randint(1, max(1, cur - 1)) if op == "-" else rng.randint(2, 9)
        res = cur + x if op == "+" else cur - x if op == "-" else cur * x
        lines.append(f"Step {i}: {cur} {op} {x} = {res}.")
        cur = res
    return lines, cur


def _math_problem(rng: random.Random, idx: int) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        start = rng.randint(2, 99)
        steps, ans = _math_steps(rng, start, rng.randint(2, 4))
        ops = " ".join(s.split(": ")[1].split(" = ")[0].split(" ", 1)[1] for s in steps)
        q = f"Compute {start} {ops} from left to right."
        return f"Problem {idx}: {q}\n" + "\n".join(steps) + f"\nAnswer: {ans}\n"
    name = rng.choice(NAMES_F + NAMES_M)
    obj = rng.choice(OBJECTS)
    if kind == 1:
        a, b = rng.randint(5, 99), rng.randint(2, 60)
        c = rng.randint(1, a + b - 1)
        other = rng.choice([n for n in NAMES_F + NAMES_M if n != name])
        q = (f"{name} has {a} {obj}. {name} buys {b} more and gives {c} to {other}. "
             f"How many {obj} does {name} have now?")
        steps, total = [f"Step 1: {a} + {b} = {a + b}.", f"Step 2: {a + b} - {c} = {a + b - c}."], a + b - c
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 30)
        extra = rng.randint(1, 40)
        q = (f"A box holds {b} {obj}. {name} has {a} boxes and {extra} loose {obj}. "
             f"How many {obj} does {name} have?")
        steps, total = [f"Step 1: {a} * {b} = {a * b}.", f"Step 2: {a * b} + {extra} = {a * b + extra}."], a * b + extra
    return f"Problem {idx}: {q}\n" + "\n".join(steps) + f"\nAnswer: {name} has {total} {obj}.\n"


def gen_math(rng: random.Random) -> str:
    """A worksheet of numbered problems solved step by step."""
    first = rng.randint(1, 20)
    return "\n".join(_math_problem(rng, first + i) for i in range(rng.randint(3, 6)))


# --------------------------------------------------------------------------- tool

CITIES = """Paris London Berlin Madrid Rome Vienna Oslo Lisbon Prague Dublin Tokyo Seoul Lima Cairo
            Nairobi Sydney Toronto Chicago Boston Denver Austin Warsaw Athens Zurich""".split()
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "stormy"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "NOK", "PLN"]
SYMBOLS = ["ACME", "GLOBX", "INITECH", "UMBR", "STARK", "WAYNE", "HOOLI", "VANDL"]
TOPICS = ["rust compilers", "sourdough bread", "solar panels", "chess openings",
          "bird migration", "tax forms", "python packaging", "electric bikes",
          "speculative decoding", "home insurance", "mountain hiking", "jazz history"]
LANGS = ["French", "German", "Spanish", "Italian", "Japanese", "Polish", "Dutch"]
DAYS = ["2024-05-01", "2024-06-12", "2024-07-30", "2024-09-03", "2024-10-21",
        "2024-11-15", "2025-01-08", "2025-02-14", "2025-03-27"]
TOOL_NAMES = ["get_weather", "convert_currency", "get_stock_price", "search_web",
              "translate", "create_event", "set_reminder", "get_time"]


def _call(name: str, args: dict[str, object]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def _tool_exchange(rng: random.Random, tools: list[str]) -> str:
    """User request -> call of one of ``tools`` -> tool result -> assistant answer."""
    t = TOOL_NAMES.index(rng.choice(tools))
    if t == 0:
        city, unit = rng.choice(CITIES), rng.choice(["celsius", "fahrenheit"])
        temp, cond = rng.randint(-5, 35), rng.choice(CONDITIONS)
        ask = rng.choice([f"What's the weather in {city} in {unit}?",
                          f"How warm is it in {city} right now? Use {unit}.",
                          f"Is it {cond} in {city} today? Tell me in {unit}."])
        call = _call("get_weather", {"city": city, "unit": unit})
        res = json.dumps({"city": city, "temperature": temp, "condition": cond})
        ans = f"It is {temp} degrees {unit} and {cond} in {city}."
    elif t == 1:
        amt = rng.choice([10, 25, 50, 100, 250, 1000, rng.randint(1, 999)])
        src, dst = rng.sample(CURRENCIES, 2)
        rate = round(rng.uniform(0.2, 3.0), 2)
        ask = rng.choice([f"Convert {amt} {src} to {dst}.",
                          f"How much is {amt} {src} in {dst}?"])
        call = _call("convert_currency", {"amount": amt, "from": src, "to": dst})
        out = round(amt * rate, 2)
        res = json.dumps({"amount": out, "currency": dst, "rate": rate})
        ans = f"{amt} {src} is about {out} {dst} at a rate of {rate}."
    elif t == 2:
        sym = rng.choice(SYMBOLS)
        price = round(rng.uniform(5, 500), 2)
        ask = rng.choice([f"What is {sym} trading at?", f"Get me the stock price of {sym}."])
        call = _call("get_stock_price", {"symbol": sym})
        res = json.dumps({"symbol": sym, "price": price, "currency": "USD"})
        ans = f"{sym} is trading at {price} USD."
    elif t == 3:
        topic, n = rng.choice(TOPICS), rng.randint(1, 10)
        ask = rng.choice([f"Search the web for {topic}.",
                          f"Find me {n} articles about {topic}."])
        call = _call("search_web", {"query": topic, "max_results": n})
        res = json.dumps({"results": n, "top": f"A guide to {topic}"})
        ans = f"I found {n} results; the top one is \"A guide to {topic}\"."
    elif t == 4:
        noun, adj = rng.choice(NOUNS), rng.choice(ADJS)
        lang = rng.choice(LANGS)
        text = f"the {adj} {noun}"
        ask = f"Translate \"{text}\" into {lang}."
        call = _call("translate", {"text": text, "target_language": lang})
        res = json.dumps({"translation": f"[{lang}] {text}"})
        ans = f"In {lang}, \"{text}\" is \"[{lang}] {text}\"."
    elif t == 5:
        title = f"{rng.choice(ADJS)} {rng.choice(NOUNS)} meeting"
        day, hour = rng.choice(DAYS), f"{rng.randint(8, 18):02d}:{rng.choice(['00', '30'])}"
        ask = f"Put a \"{title}\" in my calendar on {day} at {hour}."
        call = _call("create_event", {"title": title, "date": day, "time": hour})
        res = json.dumps({"status": "created", "id": rng.randint(100, 999)})
        ans = f"Done: \"{title}\" is on your calendar for {day} at {hour}."
    elif t == 6:
        mins = rng.choice([5, 10, 15, 20, 30, 45, 60, 90])
        what = f"{rng.choice(VERBS_T)[2]} the {rng.choice(NOUNS)}"
        ask = f"Remind me to {what} in {mins} minutes."
        call = _call("set_reminder", {"text": what, "minutes": mins})
        res = json.dumps({"status": "scheduled", "minutes": mins})
        ans = f"OK, I will remind you to {what} in {mins} minutes."
    else:
        city = rng.choice(CITIES)
        hour = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        ask = rng.choice([f"What time is it in {city}?", f"Tell me the local time in {city}."])
        call = _call("get_time", {"city": city})
        res = json.dumps({"city": city, "time": hour})
        ans = f"It is {hour} in {city}."
    return f"User: {ask}\nAssistant: {call}\nTool: {res}\nAssistant: {ans}\n"


def gen_tool(rng: random.Random) -> str:
    """A session: the tool list, then a few request/call/result/answer exchanges."""
    tools = rng.sample(TOOL_NAMES, rng.randint(3, 6))
    body = "\n".join(_tool_exchange(rng, tools) for _ in range(rng.randint(2, 5)))
    return f"Tools: {', '.join(tools)}\n\n{body}"


GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "prose": gen_prose, "code": gen_code, "math": gen_math, "tool": gen_tool,
}

# --------------------------------------------------------------------------- corpus API


def training_docs(bytes_per_class: int, seed: int = TRAIN_SEED) -> dict[str, list[str]]:
    """Documents per class, about ``bytes_per_class`` bytes each, from one seeded stream."""
    out: dict[str, list[str]] = {}
    for ci, cls in enumerate(CLASSES):
        rng = random.Random(seed * 10 + ci)
        docs: list[str] = []
        total = 0
        while total < bytes_per_class:
            d = GENERATORS[cls](rng)
            assert d.isascii(), cls
            docs.append(d)
            total += len(d)
        out[cls] = docs
    return out


def _cut(rng: random.Random, text: str) -> str | None:
    """A prefix of PROMPT_MIN..MAX bytes that ends mid-text and splits no control token."""
    hi = min(PROMPT_MAX_BYTES, len(text) - 40)
    if hi < PROMPT_MIN_BYTES:
        return None
    for _ in range(50):
        end = rng.randint(PROMPT_MIN_BYTES, hi)
        p = text[:end]  # ends inside a word or right after punctuation, and inside no control token
        if not p.endswith((" ", "\n")) and not any(p.endswith(s[:k]) for s in TEXT_SPECIALS for k in range(1, len(s))):
            return p
    return None


def held_out_prompts(train: dict[str, list[str]], seed: int = PROMPT_SEED,
                     n: int = PROMPTS_PER_CLASS) -> dict[str, list[dict[str, str]]]:
    """Prompt prefixes of fresh documents, rejected if they occur in the training text."""
    out: dict[str, list[dict[str, str]]] = {}
    for ci, cls in enumerate(CLASSES):
        rng = random.Random(seed * 10 + ci)
        joined = "\x00".join(train[cls])
        rows: list[dict[str, str]] = []
        while len(rows) < n:
            p = _cut(rng, GENERATORS[cls](rng))
            if p is not None and p not in joined and all(r["prompt"] != p for r in rows):
                rows.append({"id": f"{cls}-{len(rows):02d}", "class": cls, "prompt": p})
        out[cls] = rows
    return out


def write_prompts(prompts: dict[str, list[dict[str, str]]], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for cls, rows in prompts.items():
        (out_dir / f"{cls}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="ascii")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes-per-class", type=int, default=BYTES_PER_CLASS)
    ap.add_argument("--show", choices=CLASSES, help="print one sample document of a class")
    args = ap.parse_args()
    if args.show:
        print(GENERATORS[args.show](random.Random(0)))
        return
    train = training_docs(args.bytes_per_class)
    write_prompts(held_out_prompts(train), HERE / "prompts")
    for cls, docs in train.items():
        print(f"{cls}: {len(docs)} docs, {sum(map(len, docs))} bytes")


if __name__ == "__main__":
    main()
