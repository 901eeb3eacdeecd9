"""The KL file: one reference and one or more candidate lanes, the prompts, and the bars.

A lane is taken from an inventory (`lane: NAME`; fields beside it override) or written inline
(`engine` and `model` at least). `quantize: {type: Q8_0}` makes a llama.cpp lane's model with the
pinned `llama-quantize`, once, into a cache. Every lane runs with speculation off (drafter and
speculation flags dropped): drafted tokens can come back without probabilities, and the gate
measures the model. Paths are relative to the file that states them; any problem is one ConfigError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from tasks.engines import engine_for
from tasks.inventory.models import BenchPlan, ConfigError, DecodePlan, FileRef, Host, Inventory, Lane
from tasks.inventory.base import _RefError, _Strict
from tasks.inventory.config_file import load_model, validate
from tasks.inventory.load import DEFAULT_INVENTORY, load_inventory
from tasks.inventory.paths import resolve
# Text every lane tokenizes before it is trusted: KL compares token ids, so one vocabulary.
TOKENIZER_PROBE = ("The quick brown fox jumps over the lazy dog. 1234567890 \"quotes\", (parens) "
                   "and\ttabs\nnew lines; def f(x): return x ** 2  # code\n{\"tool\": \"call\"}")
# Flags that turn speculation on, per engine; each is dropped with its value.
_SPEC_FLAGS = ("--spec", "--draft", "--model-draft", "-md", "--threads-draft", "--speculative")


class Quantize(_Strict):
    """Make this lane's model with llama-quantize (llama.cpp lanes only)."""

    type: Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+$")]  # e.g. Q8_0, Q4_0, Q4_K_M
    source: str | None = None  # GGUF to quantize; default: the lane's `model`


class KlLane(_Strict):
    lane: str | None = None  # an inventory lane to start from
    host: str | None = None
    engine: Literal["llamacpp", "sglang", "vllm"] | None = None
    binary: str | None = None
    model: FileRef | None = None
    quantize: Quantize | None = None
    port: Annotated[int, Field(ge=1024, le=65535)] | None = None
    context: Annotated[int, Field(ge=64)] | None = None
    threads: Annotated[int, Field(ge=1)] | None = None
    flags: list[str] | None = None
    env: dict[str, str] | None = None
    boot_timeout_s: Annotated[float, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _inline_needs_basics(self) -> KlLane:
        if self.lane is None and (self.engine is None or self.model is None):
            raise ValueError("an inline lane needs 'engine' and 'model' (or name an inventory lane with 'lane')")
        return self


class Bars(_Strict):
    """What a candidate must meet, against the reference. At least one bar."""

    max_mean_abs_dlogprob: Annotated[float, Field(ge=0)] | None = None
    max_p95_abs_dlogprob: Annotated[float, Field(ge=0)] | None = None
    max_argmax_flip_share: Annotated[float, Field(ge=0, le=1)] | None = None

    @model_validator(mode="after")
    def _some_bar(self) -> Bars:
        if all(v is None for v in self.model_dump().values()):
            raise ValueError("declare at least one bar")
        return self


class KlFile(_Strict):
    inventory: str | None = None
    prompts: str = "prompts.jsonl"
    prompt_count: Annotated[int, Field(ge=2)] = 40
    tokens_per_prompt: Annotated[int, Field(ge=1, le=8192)] = 128
    ignore_eos: bool = False
    concurrency: Annotated[int, Field(ge=1, le=256)] = 1  # prompts scored at once
    exactness_tolerance: Annotated[float, Field(ge=0)] = 1e-6  # nats, max |Δlogprob| between two scorings
    bootstrap_resamples: Annotated[int, Field(ge=2000)] = 2000
    seed: int = 20260911
    reference: str
    candidates: Annotated[list[str], Field(min_length=1)]
    lanes: Annotated[dict[str, KlLane], Field(min_length=2)]
    bars: Bars

    @model_validator(mode="after")
    def _names(self) -> KlFile:
        for field, name in [("reference", self.reference), *((f"candidates[{i}]", c) for i, c in enumerate(self.candidates))]:
            if name not in self.lanes:
                raise _RefError(field, f"names lane {name!r}, which is not under 'lanes'", f"use one of: {', '.join(self.lanes)}")
        if self.reference in self.candidates:
            raise _RefError("candidates", f"lists the reference {self.reference!r}", "remove it: the reference is scored twice anyway")
        if len(set(self.candidates)) != len(self.candidates):
            raise _RefError("candidates", "names a lane twice", "list each candidate once")
        return self


class ResolvedLane(BaseModel):
    """A KL lane made concrete: the lanebench Lane to boot, its host and how its model is made."""

    name: str
    lane: Lane
    host: Host
    base_dir: Path  # where the lane's relative paths were written
    quantize: Quantize | None = None
    quantize_source: Path | None = None  # absolute
    dropped_flags: list[str] = []
    inventory: Inventory | None = None  # for its hosts' transports, RPC workers and links


def load_kl_file(path: str | Path) -> KlFile:
    path = Path(path)
    spec = load_model(path, KlFile, missing_fix="pass an existing KL file, e.g. kl/rehearsal.yaml",
                      keys="'reference', 'candidates', 'lanes' and 'bars'", example="kl/rehearsal.yaml",
                      fixes={"extra_forbidden": "remove it, or check its spelling against the fields documented in "
                                                "kl/rehearsal.yaml"})
    prompts = resolve(path.parent, spec.prompts)
    if not prompts.is_file():
        raise ConfigError(path, "prompts", f"prompt file {prompts} does not exist",
                          "point it at a JSONL file of {id, class, prompt} lines (relative to this file)")
    return spec


def strip_speculation(flags: list[str]) -> tuple[list[str], list[str]]:
    """(kept, dropped): speculation flags go with their value (`--flag value` or `--flag=value`)."""
    kept: list[str] = []
    dropped: list[str] = []
    skip_value = False
    for i, flag in enumerate(flags):
        drop = skip_value or flag.startswith(_SPEC_FLAGS)
        skip_value = not skip_value and drop and "=" not in flag and i + 1 < len(flags) and not flags[i + 1].startswith("--")
        (dropped if drop else kept).append(flag)
    return kept, dropped


def resolve_lanes(spec: KlFile, kl_path: Path) -> dict[str, ResolvedLane]:
    """Every lane of the file as a bootable Lane (speculation off, one slot per concurrent prompt)."""
    kl_path = kl_path.resolve()
    inv_path = resolve(kl_path.parent, spec.inventory) if spec.inventory else DEFAULT_INVENTORY
    needs_inventory = any(k.lane is not None or k.host is not None for k in spec.lanes.values())
    inventory = load_inventory(inv_path, engine_for) if needs_inventory else None
    prompts = str(resolve(kl_path.parent, spec.prompts))
    out: dict[str, ResolvedLane] = {}
    for name, k in spec.lanes.items():
        field = f"lanes.{name}"
        if k.lane is not None:
            assert inventory is not None
            if k.lane not in inventory.lanes:
                raise ConfigError(kl_path, f"{field}.lane", f"no lane {k.lane!r} in {inv_path}",
                                  f"use one of: {', '.join(inventory.lanes)}")
            base = inventory.lanes[k.lane]  # its paths stay relative to the inventory, wherever its host is
            base_dir = inv_path.parent
        else:
            base, base_dir = None, kl_path.parent
        overrides = k.model_dump(exclude={"lane", "model", "quantize"}, exclude_none=True)
        if k.model is not None:
            overrides["model"] = {**k.model.model_dump(), "path": str(resolve(kl_path.parent, k.model.path))}
        data = {**(base.model_dump() if base else {"host": "localhost"}), **overrides, "drafter": None, "speculative": None,
                "gates": [], "slots": spec.concurrency, "bench": BenchPlan(decode=DecodePlan(prompts=prompts)).model_dump()}
        data["flags"], dropped = strip_speculation(list(data.get("flags") or []))
        lane = validate(kl_path, Lane, data, under=field, context={"engine_for": engine_for})
        if inventory is not None and lane.host in inventory.hosts:
            host = inventory.hosts[lane.host]
        elif lane.host == "localhost":
            host = Host()
        else:
            raise ConfigError(kl_path, f"{field}.host", f"host {lane.host!r} is not in {inv_path}",
                              "name a host of the inventory, or leave 'host' out for this machine")
        source = None
        if k.quantize is not None:
            if not engine_for(lane.engine).serves_quantized_gguf:
                raise ConfigError(kl_path, f"{field}.quantize", f"quantize needs a llamacpp lane, this one is {lane.engine}",
                                  "remove 'quantize' and point 'model' at the quantized checkpoint")
            source = resolve(kl_path.parent, k.quantize.source) if k.quantize.source else resolve(base_dir, lane.model.path)
        out[name] = ResolvedLane(name=name, lane=lane, host=host, base_dir=base_dir, quantize=k.quantize,
                                 quantize_source=source, dropped_flags=dropped, inventory=inventory)
    return out
