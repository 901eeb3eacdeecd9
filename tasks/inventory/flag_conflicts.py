"""A lane field and a raw flag that say different things: a config error before boot.

In the field reports a lane declared one draft width and a flag passed another, so every acceptance
row carried the wrong K. The lane's fields become engine flags, and a flag in `flags` wins on the
command line, so the two must agree. llama.cpp's spellings are from common/arg.cpp of the pinned tree.
SGLang and vLLM count the width their own way, so their whole argv is resolved as the release does
(`Engine.draft_plan`) and the K it will run is compared with the declared K.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
    "drafter.path": (("--speculative-draft-model-path", "--speculative-draft-model"),
                     lambda lane: lane.drafter.path if lane.drafter else None),
}



@dataclass(frozen=True)
class LaneRules:
    """What the inventory asks of an engine's lane (data here: the schema sits below engines/)."""

    rpc: bool = False  # spans hosts with llama.cpp's RPC backend: takes `rpc`, its nodes become the rpc plan
    node_env: bool = True  # its node processes take `nodes.env`
    draft_plan: bool = True  # draft width and method compared on the argv it resolves (`Engine.draft_plan`)
    flags: dict[str, tuple[tuple[str, ...], _Getter]] = field(default_factory=dict)  # field -> flag spellings
    # The variable the server reads its API key from, so the key never reaches its argv (ps,
    # /proc/PID/cmdline). None: a key only on the command line, so a keyed lane is refused (api_key.py).
    api_key_env: str | None = None


RULES = {
    # common/arg.cpp: --api-key ... set_env("LLAMA_API_KEY"); only /health is exempt
    "llamacpp": LaneRules(rpc=True, node_env=False, draft_plan=False, flags=_LLAMACPP, api_key_env="LLAMA_API_KEY"),
    # no key variable: 0.5.23 reads a key only from --api-key or --config (arg_groups/fields/serving.py)
    "sglang": LaneRules(flags=_SGLANG),
    # serve/middleware/register.py (0.32.0): `args.api_key or [envs.VLLM_API_KEY]`
    "vllm": LaneRules(api_key_env="VLLM_API_KEY"),
}
# An engine adapter by name (tasks.engines.engine_for), handed down by whoever validates a lane: the
# draft plan is read from the argv as the engine's release resolves it, which only the engine knows.
EngineFor = Callable[[str], Any]


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


def draft_conflicts(lane: Any, engine: Any) -> list[tuple[str, str, str]]:
    """The lane's speculative method and K against what the engine will run for its argv."""
    plan = engine.draft_plan(engine.launch_command(lane, "engine", "0.0.0.0"))
    spec = lane.speculative
    if plan is None:
        return []
    if spec is None:
        return [("flags", f"flag --speculative-algorithm {plan.method} in 'flags' turns on speculation, but the lane "
                          "declares no 'speculative'", "declare speculative: {k: ..., method: ...} and drop the flag")]
    if plan.method is not None and not engine.same_method(plan.method, spec.method):
        return [("speculative.method", f"declared {spec.method} ({engine.name} spells it "
                                       f"{engine.method_name(spec.method)}), but 'flags' says {plan.method}",
                 f"set speculative.method to {plan.method} or remove the method flag from 'flags'")]
    if plan.k != spec.k:
        runs = f"K={plan.k}" if plan.k is not None else "a K it picks at boot"
        return [("speculative.k", f"declared K={spec.k}, but {plan.flag} makes {engine.name} draft {runs} "
                                  f"(draft tokens per verification step); every row would carry K={spec.k}",
                 f"set speculative.k to {plan.k} or drop {plan.flag.split()[0]} from 'flags' (lanebench emits "
                 f"the width flags from speculative.k)" if plan.k is not None else
                 f"give {plan.flag.split()[0]} for K={spec.k} in 'flags', or drop the flag that unset it")]
    return []


def conflicts(lane: Any, engine_for: EngineFor | None) -> list[tuple[str, str, str]]:
    """(field, problem, fix) per lane field a flag contradicts, both values named. Without
    `engine_for` (a lane built in code, not loaded) the draft plan is not read."""
    rules = RULES[lane.engine]
    out = draft_conflicts(lane, engine_for(lane.engine)) if rules.draft_plan and engine_for else []
    for label, (names, declared_of) in rules.flags.items():
        declared = declared_of(lane)
        for given in flag_values(list(lane.flags), names):
            if declared is None:
                if label.startswith("speculative"):
                    out.append(("flags", f"flag {names[0]} {given} sets {label}, but the lane declares no 'speculative'",
                                "declare speculative: {k: ..., method: ...} and drop the flag"))
            elif not (given == declared or (label.endswith("path") and given.rsplit("/", 1)[-1] == declared.rsplit("/", 1)[-1])):
                out.append((label, f"declared {declared}, but flag {names[0]} in 'flags' says {given} (the flag "
                                   f"would win on the command line while every row carried {label}={declared})",
                            f"set {label} to {given} or remove {names[0]} from 'flags'"))
    return out
