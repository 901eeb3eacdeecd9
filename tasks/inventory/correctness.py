"""A lane's correctness declarations: its agentic workload (tools, reasoning, thinking switch),
the tool-call gate and its pinned protocol, and the needle ladder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tasks.inventory.base import _NAME, _SAFE_FLAG, _Strict
from tasks.inventory.config_file import load_model


# The values that turn thinking on and off, per chat-template switch, unless a lane says otherwise.
# reasoning_effort "none" is OpenAI's word for no reasoning; a template may want "low" instead.
THINKING_DEFAULTS: dict[str, tuple[bool | str, bool | str]] = {
    "enable_thinking": (True, False),
    "reasoning_effort": ("high", "none"),
}


class ThinkingSwitch(_Strict):
    """One way to toggle thinking: a chat-template kwarg and the values that mean on and off.

    The seeds met a template that honours `enable_thinking` and ignores `reasoning_effort`,
    and one that does the reverse: a client sending the wrong switch silently gets the wrong
    regime. The thinking check sends `chat_template_kwargs: {name: on}` and `{name: off}` and
    fails naming the switch when the regime does not change.
    """

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
    """What the lane serves beyond plain text, and how the engine is told.

    In the seeds the server aced every throughput bench while tool calls never fired and
    chain-of-thought leaked into replies: two parser flags were missing. A lane declares here
    what it serves; the agentic smoke gate then proves it on the booted server, and the engine
    adapter turns it into flags (tasks/engines/*.py `agentic_flags`):

    - `tools`: a tool request must come back as structured `tool_calls`, not text.
    - `tool_parser`: SGLang/vLLM `--tool-call-parser NAME` (vLLM adds `--enable-auto-tool-choice`);
      llama.cpp has no such flag: it reads the tool-call format from the chat template.
    - `reasoning`: reasoning must come back apart from the content (`reasoning_content`).
    - `reasoning_parser`: SGLang/vLLM `--reasoning-parser NAME`; llama.cpp `--reasoning-format NAME`
      (`deepseek` when `reasoning` is true and no name is given).
    - `chat_template`: a Jinja template file (llama.cpp `--jinja --chat-template-file`, SGLang and
      vLLM `--chat-template`); relative to this file.
    - `thinking_switch`: how thinking is toggled, e.g. `[enable_thinking]` or
      `[{name: reasoning_effort, on: high, off: low}]`; each is checked on the booted server.
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
    """The tool-call gate: suites graded AST-style under a pinned protocol (toolsuites/README.md).

    `dev` runs on every lane run; `held_out` only when asked (`lanebench tools --held-out`),
    and every run of it is counted in the manifest, so a held-out score that was looked at
    twenty times is seen as such. With `min_solved_pct` the dev score gates the lane;
    without it the score is reported only.
    """

    dev: str
    held_out: str | None = None
    protocol: str = "toolsuites/protocol.yaml"
    min_solved_pct: Annotated[float, Field(ge=0, le=100)] | None = None


NeedleKind = Literal["one_key", "five_keys", "distractors"]


class NeedlePlan(_Strict):
    """The needle ladder: each needle kind at each rung (prompt tokens), up to the lane's context.

    Without `rungs`, three rungs at about a quarter, a half and all of what the context per
    slot leaves after `max_tokens`. With `must_pass` every rung must pass (a truncated answer
    is not a pass); otherwise the ladder is reported only.
    """

    kinds: Annotated[list[NeedleKind], Field(min_length=1)] = ["one_key", "five_keys", "distractors"]
    rungs: Annotated[list[Annotated[int, Field(ge=32)]], Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] = 32
    must_pass: bool = False


class ToolProtocol(_Strict):
    """How every tool-gate request is sent (toolsuites/protocol.yaml). Changing any of it makes
    scores incomparable, so the protocol is copied into the manifest with every score."""

    temperature: Annotated[float, Field(ge=0)] = 0.0
    tool_choice: Literal["auto", "required"] = "auto"
    # Sent through the lane's declared thinking switch (agentic.thinking_switch); "default"
    # leaves the server's default.
    thinking: Literal["off", "on", "default"] = "off"
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
