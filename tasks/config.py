"""The inventory: hosts, the links between them, and the lanes that run on them.

`hosts.yaml` is loaded into these pydantic models. Every way a file can be wrong ends in
one `ConfigError` naming the file, the field and the fix, so the CLI can print one line
and exit 2 instead of a traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Values that end up on a command line are checked against these before they are quoted.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_SAFE_FLAG = re.compile(r"^[A-Za-z0-9_./:=,@+%{}\[\]\"' -]*$")


class ConfigError(Exception):
    """A bad configuration: says which file, which field, and how to fix it."""

    def __init__(self, file: str | Path, field: str, problem: str, fix: str) -> None:
        self.file, self.field, self.problem, self.fix = str(file), field, problem, fix
        super().__init__(f"{file}: {field}: {problem}. Fix: {fix}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostPaths(_Strict):
    models: str = "."
    artifacts: str = "artifacts"


class Host(_Strict):
    """A machine lanes run on. `transport: local` runs commands here; `ssh` reaches it over SSH
    (paramiko, key authentication, host key checked against `known_hosts`)."""

    address: str = "127.0.0.1"
    transport: Literal["local", "ssh"] = "local"
    user: str | None = None
    port: Annotated[int, Field(ge=1, le=65535)] = 22
    # SSH: the private key to log in with, and the known_hosts file the host's key must be in
    # (both relative to the inventory; default ~/.ssh/id_ed25519 and ~/.ssh/known_hosts).
    identity_file: str | None = None
    known_hosts: str | None = None
    # Accept and record an unknown host key on first contact. Off unless a host opts in: a
    # changed key is refused whatever this says.
    trust_on_first_use: bool = False
    keepalive_s: Annotated[float, Field(gt=0)] = 15.0
    connect_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    # The docker daemon container lanes run on, as `docker --host` takes it
    # (default: the docker CLI's own default on that host).
    docker_host: Annotated[str, Field(pattern=r"^(unix|tcp)://[A-Za-z0-9_./:-]+$")] | None = None
    gpus: Annotated[int, Field(ge=0)] = 0
    paths: HostPaths = HostPaths()
    # What an hour of this box costs (amortized hardware, rent or cloud price): prices the
    # tool gate as dollars per 1,000 solved cases, the seeds' "$0.20 per 1,000 solved".
    dollars_per_hour: Annotated[float, Field(ge=0)] | None = None

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9.:-]+", v):
            raise ValueError("must be a host name or an IP address (letters, digits, '.', ':', '-')")
        return v


class LinkEnd(_Strict):
    host: str
    interface: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.@-]{1,15}$")]
    address: Annotated[str, Field(pattern=r"^[0-9A-Fa-f.:]+$")]


class Link(_Strict):
    """A direct cable between two hosts (e.g. the Spark1<->Spark2 RoCE link): both ends must be
    up with the expected MTU and reach each other over the link addresses before a lane that
    needs it boots. Bandwidth is probed (iperf3) only where `min_gbps` is set."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
    a: LinkEnd
    b: LinkEnd
    mtu: Annotated[int, Field(ge=68, le=65536)] | None = None
    min_gbps: Annotated[float, Field(gt=0)] | None = None


class ContainerSettings(_Strict):
    """How a container lane's engine container runs (host network always: the bench reaches
    the server on the host's address). Model files are mounted read-only at their host paths."""

    ipc: Literal["host", "private", "shareable"] = "host"
    shm_size: Annotated[str, Field(pattern=r"^[0-9]+[bkmg]?$")] = "1g"
    mounts: list[Annotated[str, Field(pattern=r"^/[A-Za-z0-9_./-]*:/[A-Za-z0-9_./-]*(:ro|:rw)?$")]] = []
    entrypoint_binary: str = "/llama-server"  # the engine's executable inside the image


class RpcPlan(_Strict):
    """llama.cpp's RPC backend across hosts: `rpc-server` on each worker, listening on its end of
    `link`, and the lane's `llama-server --rpc` on the lane's host. Cutting the link breaks the lane."""

    workers: Annotated[list[str], Field(min_length=1)]
    link: str
    port: Annotated[int, Field(ge=1024, le=65535)] = 50052
    binary: str | None = None  # rpc-server on the workers; default: the pinned build's


class FileRef(_Strict):
    """A model or drafter file with the size it must have (and optionally its sha256)."""

    path: str
    bytes: Annotated[int, Field(gt=0)] | None = None
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    revision: str | None = None


class Speculative(_Strict):
    """Speculative decoding: the engine's method name and the draft width K."""

    method: str = "draft-simple"
    k: Annotated[int, Field(ge=1, le=64)] = 4


class DecodePlan(_Strict):
    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)] = [1, 2, 4, 8]
    max_tokens: Annotated[int, Field(ge=1)] = 64
    requests_per_stream: Annotated[int, Field(ge=1)] = 2
    prompts: str


class AcceptancePlan(_Strict):
    classes: Annotated[dict[str, str], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] = 96
    prompts_per_class: Annotated[int, Field(ge=1)] = 8


class BenchPlan(_Strict):
    repeats: Annotated[int, Field(ge=1, le=50)] = 3
    decode: DecodePlan
    acceptance: AcceptancePlan | None = None


class CounterGate(_Strict):
    """A metric or log counter that must meet a condition after a probe request.

    With `metric`, the value is the counter's increase over the probe (a counter that did
    not move reads 0). With `log_pattern`, the value is the named group `value` of the
    last match in the boot log after the probe.
    """

    kind: Literal["counter"]
    name: str
    metric: str | None = None
    log_pattern: str | None = None
    op: Literal[">", ">=", "<", "<=", "==", "!="]
    threshold: float

    @model_validator(mode="after")
    def _one_source(self) -> CounterGate:
        if (self.metric is None) == (self.log_pattern is None):
            raise ValueError("give exactly one of 'metric' or 'log_pattern'")
        if self.log_pattern is not None:
            try:
                if "value" not in re.compile(self.log_pattern).groupindex:
                    raise ValueError("log_pattern needs a named group (?P<value>...)")
            except re.error as e:
                raise ValueError(f"log_pattern is not a valid regular expression: {e}") from e
        return self


class CapacityGate(_Strict):
    """Fails the boot when the bench asks for more concurrent requests than the server runs."""

    kind: Literal["capacity"]
    name: str = "capacity"


Gate = Annotated[CounterGate | CapacityGate, Field(discriminator="kind")]


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
    """Read a protocol file; any problem is a ValueError naming the field."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("must be a mapping of protocol settings (see toolsuites/protocol.yaml)")
    try:
        return ToolProtocol.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None


class Correctness(_Strict):
    """Correctness gates on the booted server, after the speed measurements."""

    tool_gate: ToolGatePlan | None = None
    needles: NeedlePlan | None = None


class Lane(_Strict):
    """One serving configuration on one or more hosts."""

    host: str
    engine: Literal["llamacpp", "sglang", "vllm"]
    binary: str | None = None  # engine executable; llamacpp lanes default to the pinned local build
    image: Annotated[str, Field(pattern=r"^[a-z0-9._/:-]+@sha256:[0-9a-f]{64}$")] | None = None
    container: ContainerSettings = ContainerSettings()
    rpc: RpcPlan | None = None
    links: list[str] = []  # links this lane needs (rpc.link is added); a failed link skips the lane
    model: FileRef
    drafter: FileRef | None = None
    speculative: Speculative | None = None
    port: Annotated[int, Field(ge=1024, le=65535)] = 18080
    slots: Annotated[int, Field(ge=1)] = 4
    context: Annotated[int, Field(ge=64)] = 4096
    threads: Annotated[int, Field(ge=1)] | None = None
    flags: list[str] = []
    env: dict[str, str] = {}
    boot_timeout_s: Annotated[float, Field(gt=0)] = 180.0
    bench: BenchPlan
    gates: list[Gate] = []
    agentic: Agentic | None = None
    correctness: Correctness | None = None

    @model_validator(mode="after")
    def _rpc_engine(self) -> Lane:
        if self.rpc is not None and self.engine != "llamacpp":
            raise ValueError(f"rpc is llama.cpp's RPC backend; engine {self.engine} spans hosts with its own flags "
                             "(e.g. --tensor-parallel-size) and declares the link it needs under 'links'")
        return self

    @model_validator(mode="after")
    def _needles_fit(self) -> Lane:
        needles = self.correctness.needles if self.correctness else None
        if needles is not None and needles.rungs:
            room = self.context - needles.max_tokens
            if max(needles.rungs) > room:
                raise ValueError(f"needle rung {max(needles.rungs)} does not fit a context of {self.context} tokens "
                                 f"per slot with {needles.max_tokens} answer tokens (at most {room})")
        return self

    @field_validator("flags")
    @classmethod
    def _flags(cls, v: list[str]) -> list[str]:
        for flag in v:
            if not _SAFE_FLAG.fullmatch(flag):
                raise ValueError(f"flag {flag!r} has characters not allowed on a command line ($, `, ;, |, &, <, >, newline)")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
                raise ValueError(f"environment name {key!r} must be upper-case letters, digits and '_'")
            if not _SAFE_FLAG.fullmatch(value):
                raise ValueError(f"environment value of {key} has characters not allowed on a command line")
        return v


class Inventory(_Strict):
    """Everything `hosts.yaml` declares, cross-checked (lanes name known hosts, links name known ends)."""

    hosts: Annotated[dict[str, Host], Field(min_length=1)]
    links: list[Link] = []
    lanes: Annotated[dict[str, Lane], Field(min_length=1)]

    @model_validator(mode="after")
    def _references(self) -> Inventory:
        for name in [*self.hosts, *self.lanes]:
            if not _NAME.fullmatch(name):
                raise ValueError(f"name {name!r} must be letters, digits, '_', '.', '-' (at most 63)")
        for lane_name, lane in self.lanes.items():
            if lane.host not in self.hosts:
                raise _RefError(f"lanes.{lane_name}.host", f"names host {lane.host!r}, which is not under 'hosts'",
                                f"use one of: {', '.join(self.hosts)}")
        links = {link.name for link in self.links}
        for lane_name, lane in self.lanes.items():
            needed = [*lane.links, *([lane.rpc.link] if lane.rpc else [])]
            for i, name in enumerate(needed):
                if name not in links:
                    field = f"lanes.{lane_name}.links[{i}]" if i < len(lane.links) else f"lanes.{lane_name}.rpc.link"
                    raise _RefError(field, f"names link {name!r}, which is not under 'links'",
                                    f"use one of: {', '.join(links)}" if links else
                                    "declare the link under 'links' (name, a and b ends, mtu) or remove it")
            for i, worker in enumerate(lane.rpc.workers if lane.rpc else []):
                if worker not in self.hosts:
                    raise _RefError(f"lanes.{lane_name}.rpc.workers[{i}]", f"names host {worker!r}, which is not under 'hosts'",
                                    f"use one of: {', '.join(self.hosts)}")
        for i, link in enumerate(self.links):
            for end in ("a", "b"):
                host = getattr(link, end).host
                if host not in self.hosts:
                    raise _RefError(f"links[{i}].{end}.host", f"names host {host!r}, which is not under 'hosts'",
                                    f"use one of: {', '.join(self.hosts)}")
        return self


class _RefError(ValueError):
    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(problem)


_FIXES = {
    "missing": "add this field",
    "extra_forbidden": "remove it, or check its spelling against the documented fields in hosts.yaml",
    "literal_error": "use one of the allowed values",
    "int_parsing": "use a whole number",
    "int_type": "use a whole number",
    "float_parsing": "use a number",
    "string_pattern_mismatch": "write it in the documented form",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than_equal": "use a smaller value",
    "too_short": "give at least one entry",
    "dict_type": "write a mapping (key: value lines)",
    "list_type": "write a list (- item lines)",
    "union_tag_invalid": "use kind: counter or kind: capacity",
    "union_tag_not_found": "add 'kind: counter' or 'kind: capacity'",
}


def _field_path(loc: tuple) -> str:
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif item in ("counter", "capacity") and out.endswith("]"):
            continue  # the discriminated union's branch name, not a field
        else:
            out += ("." if out else "") + str(item)
    return out or "(top level)"


def read_yaml_mapping(path: Path, missing_fix: str, keys: str, example: str) -> dict:
    """A YAML file that must hold a mapping: a missing file, a syntax error (with its line and
    column) or another top-level shape is one ConfigError, for every lanebench input file."""
    if not path.is_file():
        raise ConfigError(path, "(file)", "no such file", missing_fix)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(syntax)"
        raise ConfigError(path, where, f"not valid YAML ({getattr(e, 'problem', e)})", "fix the YAML syntax at that place") from None
    if not isinstance(raw, dict):
        raise ConfigError(path, "(top level)", f"must be a mapping with {keys}", f"start from {example}")
    return raw


def load_inventory(path: str | Path) -> Inventory:
    """Read and validate an inventory file; any problem is one ConfigError."""
    path = Path(path)
    raw = read_yaml_mapping(path, "pass an existing file with --hosts, or run without --hosts for the rehearsal lane",
                            "'hosts' and 'lanes'", "the shipped hosts.yaml")
    try:
        return Inventory.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _RefError):
            raise ConfigError(path, ctx_err.field, ctx_err.problem, ctx_err.fix) from None
        field = _field_path(tuple(err["loc"]))
        problem = err["msg"].removeprefix("Value error, ")
        if err["type"] == "literal_error":
            fix = f"use {err['ctx']['expected']}"
        else:
            fix = _FIXES.get(err["type"], "correct the value as the message says")
        more = len(e.errors()) - 1
        if more:
            problem += f" (and {more} more problem{'s' if more > 1 else ''} after this one)"
        raise ConfigError(path, field, problem, fix) from None


REPO_DIR = Path(__file__).resolve().parent.parent


def shipped_or_local(base: Path, rel: str) -> Path:
    """A file the inventory names: relative to the inventory's folder; a relative path missing
    there is looked up in the lanebench checkout, so the shipped tool suites, protocol and chat
    templates work from an inventory kept anywhere."""
    p = Path(rel)
    if p.is_absolute():
        return p
    local = (base / p).resolve()
    if not local.exists() and (REPO_DIR / p).exists():
        return (REPO_DIR / p).resolve()
    return local


def check_prompt_files(inventory: Inventory, path: str | Path) -> None:
    """Prompt sets are input, not preconditions: a missing one is a ConfigError before anything runs.

    So are the correctness gates' inputs: chat template, tool suites and tool protocol must exist
    and parse (a bad suite line is named by line number).
    """
    base = Path(path).resolve().parent
    for name, lane in inventory.lanes.items():
        files = {f"lanes.{name}.bench.decode.prompts": lane.bench.decode.prompts}
        if lane.bench.acceptance is not None:
            files |= {f"lanes.{name}.bench.acceptance.classes.{c}": p for c, p in lane.bench.acceptance.classes.items()}
        for field, rel in files.items():
            target = Path(rel) if Path(rel).is_absolute() else base / rel
            if not target.is_file():
                raise ConfigError(path, field, f"prompt file {target} does not exist",
                                  "point it at a JSONL file of {id, class, prompt} lines (paths are relative to this file)")
    for name, lane in inventory.lanes.items():
        _check_correctness_files(name, lane, base, path)


def _check_correctness_files(name: str, lane: Lane, base: Path, path: str | Path) -> None:
    from tasks.tool_grader import load_suite

    checks: list[tuple[str, str, object, str]] = []
    if lane.agentic is not None and lane.agentic.chat_template is not None:
        checks.append((f"lanes.{name}.agentic.chat_template", lane.agentic.chat_template, None,
                       "point it at a Jinja chat template file (e.g. testbed/chat/testbed.jinja)"))
    plan = lane.correctness.tool_gate if lane.correctness else None
    if plan is not None:
        fix = "point it at a tool suite in the JSONL format of toolsuites/README.md"
        checks.append((f"lanes.{name}.correctness.tool_gate.dev", plan.dev, load_suite, fix))
        if plan.held_out is not None:
            checks.append((f"lanes.{name}.correctness.tool_gate.held_out", plan.held_out, load_suite, fix))
        checks.append((f"lanes.{name}.correctness.tool_gate.protocol", plan.protocol, load_protocol,
                       "point it at a protocol file like toolsuites/protocol.yaml"))
    for field, rel, loader, fix in checks:
        target = shipped_or_local(base, rel)
        if not target.is_file():
            raise ConfigError(path, field, f"file {target} does not exist", fix + " (paths are relative to this file)")
        if loader is not None:
            try:
                loader(target)  # type: ignore[operator]
            except ValueError as e:
                raise ConfigError(path, field, f"{target}: {e}", fix) from None
