"""A lane's correctness declarations: its agentic workload, the tool-call gate and its protocol, the needle ladder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tasks.inventory.base import _NAME, _SAFE_FLAG, _Strict
from tasks.inventory.config_file import load_model


# (on, off) per chat-template switch unless a lane says otherwise; "none" is OpenAI's word for no
# reasoning (a template may want "low").
THINKING_DEFAULTS: dict[str, tuple[bool | str, bool | str]] = {
    "enable_thinking": (True, False),
    "reasoning_effort": ("high", "none"),
}


class ThinkingSwitch(_Strict):
    """One way to toggle thinking: a chat-template kwarg and its on and off values. The seeds met templates
    honouring `enable_thinking` but not `reasoning_effort` and the reverse, so the thinking check sends
    both values and fails naming the switch when the regime does not change."""

    name: Literal["enable_thinking", "reasoning_effort"]
    on: bool | str
    off: bool | str

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, v: object) -> object:
        if isinstance(v, str):
            v = {"name": v}
        if isinstance(v, dict) and v.get("name") in THINKING_DEFAULTS:
            on, off = THINKING_DEFAULTS[v["name"]]
            v = {"on": on, "off": off, **v}
        return v

    @model_validator(mode="after")
    def _differ(self) -> ThinkingSwitch:
        if self.on == self.off:
            raise ValueError(f"thinking switch {self.name}: 'on' and 'off' are the same value ({self.on!r})")
        return self


class Agentic(_Strict):
    """What the lane serves beyond plain text (the seeds' server aced every bench while tool calls never
    fired and thinking leaked: two parser flags were missing). The smoke gate proves it on the booted
    server; the adapter's `agentic_flags` spells it:

    - `tools`: a tool request comes back as structured `tool_calls`; `tool_parser`: SGLang/vLLM
      `--tool-call-parser` (llama.cpp reads the format from the chat template).
    - `reasoning`: reasoning comes back apart (`reasoning_content`); `reasoning_parser`: SGLang/vLLM
      `--reasoning-parser`, llama.cpp `--reasoning-format` (`deepseek` when only `reasoning` is set).
    - `chat_template`: a Jinja file relative to this file; `thinking_switch`: e.g. `[enable_thinking]`
      or `[{name: reasoning_effort, on: high, off: low}]`, each checked on the booted server.
    """

    tools: bool = False
    tool_parser: str | None = None
    reasoning: bool = False
    reasoning_parser: str | None = None
    chat_template: str | None = None
    thinking_switch: list[ThinkingSwitch] = []

    @field_validator("tool_parser", "reasoning_parser")
    @classmethod
    def _parser_name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.fullmatch(v):
            raise ValueError(f"parser name {v!r} must be letters, digits, '_', '.', '-'")
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_path(cls, v: str | None) -> str | None:
        if v is not None and not _SAFE_FLAG.fullmatch(v):
            raise ValueError(f"chat template path {v!r} has characters not allowed on a command line")
        return v

    @field_validator("thinking_switch", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        return [v] if isinstance(v, str | dict) else v


class ToolGatePlan(_Strict):
    """The tool-call gate: suites graded AST-style under a pinned protocol (toolsuites/README.md). `dev`
    runs every time; `held_out` only with `lanebench tools --held-out`, each run counted in the
    manifest (a score looked at twenty times is seen as such). `min_solved_pct` makes dev a gate."""

    dev: str
    held_out: str | None = None
    protocol: str = "toolsuites/protocol.yaml"
    min_solved_pct: Annotated[float, Field(ge=0, le=100)] | None = None


NeedleKind = Literal["one_key", "five_keys", "distractors"]


class NeedlePlan(_Strict):
    """Each needle kind at each rung (prompt tokens); default rungs a quarter, a half and all of what the
    context per slot leaves after `max_tokens`. `must_pass`: every rung passes (truncated is not)."""

    kinds: Annotated[list[NeedleKind], Field(min_length=1)] = ["one_key", "five_keys", "distractors"]
    rungs: Annotated[list[Annotated[int, Field(ge=32)]], Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] = 32
    must_pass: bool = False


class ToolProtocol(_Strict):
    """How every tool-gate request is sent (toolsuites/protocol.yaml), copied into the manifest with each
    score: changing any of it makes scores incomparable."""

    temperature: Annotated[float, Field(ge=0)] = 0.0
    tool_choice: Literal["auto", "required"] = "auto"
    thinking: Literal["off", "on", "default"] = "off"  # through agentic.thinking_switch; default: the server's
    strict: bool = False
    retries: Literal[0] = 0  # a refused request is a miss (http_error), never retried
    concurrency: Annotated[int, Field(ge=1, le=64)] = 4
    max_tokens: Annotated[int, Field(ge=1)] = 192


def load_protocol(path: str | Path) -> ToolProtocol:
    """Read a protocol file; any problem is one ConfigError naming the protocol file and field."""
    return load_model(path, ToolProtocol, missing_fix="point the lane's tool_gate.protocol at an existing file",
                      keys="protocol settings", example="toolsuites/protocol.yaml",
                      fixes={"extra_forbidden": "remove it, or check its spelling against toolsuites/protocol.yaml"})


class Correctness(_Strict):
    """Correctness gates on the booted server, after the speed measurements."""

    tool_gate: ToolGatePlan | None = None
    needles: NeedlePlan | None = None
