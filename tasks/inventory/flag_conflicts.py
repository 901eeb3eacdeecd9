"""A lane field and a raw flag that say different things: a config error before boot.

In the field reports a lane declared one draft width and a flag passed another, so every
acceptance row carried the wrong K. The lane's fields (`speculative.k`, `slots`, `context`,
`speculative.method`, `drafter`, `model`) become engine flags; the same setting in `flags`
wins on the command line (last one wins), so the two must agree or the lane is refused.

Each engine's spelling of those settings, read from its argument parser (llama.cpp
common/arg.cpp of the pinned tree; SGLang server_args.py; vLLM arg_utils.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# field label -> (flag spellings, the lane's value as the engine would be told it)
_Getter = Callable[[Any], str | None]

_LLAMACPP: dict[str, tuple[tuple[str, ...], _Getter]] = {
    "speculative.k": (("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n"),
                      lambda lane: str(lane.speculative.k) if lane.speculative else None),
    "speculative.method": (("--spec-type",), lambda lane: lane.speculative.method if lane.speculative else None),
    "slots": (("--parallel", "-np"), lambda lane: str(lane.slots)),
    "context": (("--ctx-size", "-c"), lambda lane: str(lane.context * lane.slots)),
    "drafter.path": (("--model-draft", "-md"), lambda lane: lane.drafter.path if lane.drafter else None),
    "model.path": (("--model", "-m"), lambda lane: lane.model.path),
}

_SGLANG: dict[str, tuple[tuple[str, ...], _Getter]] = {
    "speculative.k": (("--speculative-num-draft-tokens", "--speculative-dflash-block-size"),
                      lambda lane: str(lane.speculative.k) if lane.speculative else None),
    "speculative.method": (("--speculative-algorithm",), lambda lane: lane.speculative.method if lane.speculative else None),
    "drafter.path": (("--speculative-draft-model-path",), lambda lane: lane.drafter.path if lane.drafter else None),
}

_TABLES = {"llamacpp": _LLAMACPP, "sglang": _SGLANG, "vllm": {}}


def flag_values(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """Every value the flags give one setting (`--x V` and `--x=V`), in order."""
    out = []
    for i, flag in enumerate(flags):
        head, eq, tail = flag.partition("=")
        if head in names:
            if eq:
                out.append(tail)
            elif i + 1 < len(flags):
                out.append(flags[i + 1])
    return out


def conflicts(lane: Any) -> list[tuple[str, str, str]]:
    """(field, problem, fix) per lane field a flag contradicts, both values named."""
    out = []
    for label, (names, declared_of) in _TABLES.get(lane.engine, {}).items():
        declared = declared_of(lane)
        for given in flag_values(list(lane.flags), names):
            same = given == declared or (label.endswith("path") and declared is not None
                                         and given.rsplit("/", 1)[-1] == declared.rsplit("/", 1)[-1])
            if declared is None:
                if label.startswith("speculative"):
                    out.append(("flags", f"flag {names[0]} {given} sets {label}, but the lane declares no 'speculative'",
                                "declare speculative: {k: ..., method: ...} and drop the flag"))
                continue
            if not same:
                out.append((label, f"declared {declared}, but flag {names[0]} in 'flags' says {given} (the flag "
                                   f"would win on the command line while every row carried {label}={declared})",
                            f"set {label} to {given} or remove {names[0]} from 'flags'"))
    return out
