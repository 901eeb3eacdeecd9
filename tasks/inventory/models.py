"""The inventory (`hosts.yaml`): hosts, the links between them, and the lanes that run on them.
Every way the file can be wrong ends in one `ConfigError` naming file, field and fix (exit 2)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationInfo, field_validator, model_validator

from tasks.inventory import api_key
from tasks.inventory.base import _NAME, _SAFE_FLAG, ConfigError, _RefError, _Strict  # noqa: F401  (re-exported)
from tasks.inventory.benches import AcceptancePlan, AccuracyPlan, BenchPlan, BeyondCap, CapacityPlan, DecodePlan, PrefillPlan  # noqa: F401
from tasks.inventory.correctness import (Agentic, Correctness, NeedleKind, NeedlePlan, ThinkingSwitch,  # noqa: F401
                                         ToolGatePlan, ToolProtocol, load_protocol)
from tasks.inventory.flag_conflicts import RULES, LaneRules, conflicts


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
    # Relative to the inventory; default ~/.ssh/id_ed25519 and ~/.ssh/known_hosts.
    identity_file: str | None = None
    known_hosts: str | None = None
    trust_on_first_use: bool = False  # record an unknown host key on first contact; a changed key is refused
    keepalive_s: Annotated[float, Field(gt=0)] = 15.0
    connect_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    # As `docker --host` takes it (default: the docker CLI's own default on that host).
    docker_host: Annotated[str, Field(pattern=r"^(unix|tcp)://[A-Za-z0-9_./:-]+$")] | None = None
    gpus: Annotated[int, Field(ge=0)] = 0
    # Preflight refuses to boot while other processes hold more than this share of a GPU's memory.
    gpu_max_busy_share: Annotated[float, Field(ge=0, le=1)] = 0.1
    memory_gbps: Annotated[float, Field(gt=0)] | None = None  # prices each decode row as a share of the bandwidth limit
    paths: HostPaths = HostPaths()
    # What an hour of this box costs: the tool gate's dollars per 1,000 solved cases (the seeds' "$0.20").
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
    """A direct cable between two hosts (e.g. Spark1<->Spark2 RoCE): both ends up, with the MTU, reaching
    each other before a lane that needs it boots; bandwidth (iperf3) only with `min_gbps`."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
    a: LinkEnd
    b: LinkEnd
    mtu: Annotated[int, Field(ge=68, le=65536)] | None = None
    min_gbps: Annotated[float, Field(gt=0)] | None = None

    def end(self, host: str) -> LinkEnd | None:
        """The link's end on `host` (None: the host is on neither end)."""
        return self.a if self.a.host == host else self.b if self.b.host == host else None


class ContainerSettings(_Strict):
    """How a container lane's engine runs (always host network); model files mounted read-only at their paths."""

    ipc: Literal["host", "private", "shareable"] = "host"
    shm_size: Annotated[str, Field(pattern=r"^[0-9]+[bkmg]?$")] = "1g"
    mounts: list[Annotated[str, Field(pattern=r"^/[A-Za-z0-9_./-]*:/[A-Za-z0-9_./-]*(:ro|:rw)?$")]] = []
    # The engine's executable inside the image (`docker run --entrypoint`): python3 for SGLang, vllm for vLLM.
    entrypoint_binary: Annotated[str, Field(pattern=r"^[A-Za-z0-9_./-]+$")] = "/llama-server"


class RpcPlan(_Strict):
    """llama.cpp's RPC backend: `rpc-server` on each worker on its end of `link`, `llama-server --rpc` on the lane's host."""

    workers: Annotated[list[str], Field(min_length=1)]
    link: str
    port: Annotated[int, Field(ge=1024, le=65535)] = 50052
    binary: str | None = None  # rpc-server on the workers; default: the pinned build's


def check_env(v: dict[str, str]) -> dict[str, str]:
    """Environment names and values that can reach a process safely (never a command line)."""
    for key, value in v.items():
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
            raise ValueError(f"environment name {key!r} must be upper-case letters, digits and '_'")
        if not _SAFE_FLAG.fullmatch(value):
            raise ValueError(f"environment value of {key} has characters not allowed on a command line")
    return v


class NodesPlan(_Strict):
    """One lane across hosts, rank r on `hosts[r]`: rank 0 the head (the lane's host, serving HTTP), the
    others the engine's workers (vLLM `--headless`, SGLang `--node-rank r`, llama.cpp `rpc-server`),
    meeting at the head's end of `link` on `port`."""

    hosts: Annotated[list[str], Field(min_length=2, max_length=64)]
    link: str | None = None
    # vLLM --master-port and SGLang's --dist-init-addr port (default 29501); llama.cpp's rpc-server port (50052).
    port: Annotated[int, Field(ge=1024, le=65535)] | None = None
    # By host: merged over the lane's `env` (each link end has its own NCCL_SOCKET_IFNAME, VLLM_HOST_IP).
    env: dict[str, dict[str, str]] = {}

    @model_validator(mode="after")
    def _node_env(self) -> NodesPlan:
        for host, env in self.env.items():
            if host not in self.hosts:
                raise ValueError(f"nodes.env names host {host!r}, which is not one of nodes.hosts {self.hosts}")
            check_env(env)
        return self


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


class CounterGate(_Strict):
    """A counter that must meet a condition after a probe request: a `metric`'s increase over the probe
    (0 if it did not move), or the named group `value` of the last `log_pattern` match in the boot log."""

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
        if self.metric is not None and always_true(self.op, self.threshold):
            raise _RefError(".threshold", f"gate {self.name!r}: the increase of counter {self.metric} over the probe "
                            f"is never below 0, so '{self.op} {self.threshold:g}' cannot fail and proves nothing",
                            "make it a condition that can fail, e.g. op: '>' with threshold: 0 (the counter moved), "
                            "or remove the gate")
        return self

    def implies(self, op: str, threshold: float) -> bool:
        """Whether passing this gate means `op threshold` passes too (an implied gate is then redundant)."""
        return self.metric is not None and op == ">" and (
            (self.op == ">" and self.threshold >= threshold) or (self.op in (">=", "==") and self.threshold > threshold))


def always_true(op: str, threshold: float) -> bool:
    """A condition every counter increase (a number >= 0) meets: a gate that cannot fail."""
    return (op == ">=" and threshold <= 0) or (op in (">", "!=") and threshold < 0)


class CapacityGate(_Strict):
    """Fails the boot when the bench asks for more concurrent requests than the server runs."""

    kind: Literal["capacity"]
    name: str = "capacity"


Gate = Annotated[CounterGate | CapacityGate, Field(discriminator="kind")]


class Waiver(_Strict):
    """Turning off an implied gate takes a reason, recorded and reported: silent opt-outs let the seeds' mistakes pass."""

    gate: Literal["counter", "capacity", "draft-width", "synthetic", "unstable"]
    reason: Annotated[str, Field(min_length=8)]


class Lane(_Strict):
    """One serving configuration on one or more hosts."""

    host: str
    engine: Literal["llamacpp", "sglang", "vllm"]
    binary: str | None = None  # engine executable; llamacpp lanes default to the pinned local build
    image: Annotated[str, Field(pattern=r"^[a-z0-9._/:-]+@sha256:[0-9a-f]{64}$")] | None = None
    container: ContainerSettings = ContainerSettings()
    rpc: RpcPlan | None = None
    nodes: NodesPlan | None = None  # the lane across hosts (all engines; llama.cpp: its rpc plan)
    links: list[str] = []  # links this lane needs (rpc.link is added); a failed link skips the lane
    model: FileRef
    drafter: FileRef | None = None
    speculative: Speculative | None = None
    port: Annotated[int, Field(ge=1024, le=65535)] = 18080
    slots: Annotated[int, Field(ge=1)] = 4
    context: Annotated[int, Field(ge=64)] = 4096
    threads: Annotated[int, Field(ge=1)] | None = None
    flags: list[str] = []
    env: Annotated[dict[str, str], AfterValidator(check_env)] = {}
    # Env names and flags whose values are secret (besides *_TOKEN, *_KEY, --api-key ...), and those kept
    # in clear although they look like credentials (tasks/inventory/secrets.py).
    secrets: list[Annotated[str, Field(pattern=r"^(--?[A-Za-z0-9][A-Za-z0-9-]*|[A-Z_][A-Z0-9_]*)$")]] = []
    not_secrets: list[Annotated[str, Field(pattern=r"^(--?[A-Za-z0-9][A-Za-z0-9-]*|[A-Z_][A-Z0-9_]*)$")]] = []
    # The server's API key, by reference only (tasks/inventory/api_key.py).
    api_key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    api_key_file: str | None = None
    boot_timeout_s: Annotated[float, Field(gt=0)] = 180.0
    bench: BenchPlan
    gates: list[Gate] = []
    waivers: list[Waiver] = []  # implied gates turned off, each with its reason
    agentic: Agentic | None = None
    correctness: Correctness | None = None

    @model_validator(mode="before")
    @classmethod
    def _inline_key(cls, data: object) -> object:
        return api_key.refuse_inline(data)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Lane:
        api_key.check(self)
        if self.rpc is not None and not RULES[self.engine].rpc:
            raise ValueError(f"rpc is llama.cpp's RPC backend; engine {self.engine} spans hosts with 'nodes' "
                             "(nodes: {hosts: [head, worker], link: LINK}) plus its parallel flags "
                             "(e.g. --tensor-parallel-size)")
        if found := conflicts(self, (info.context or {}).get("engine_for")):
            field, problem, fix = found[0]
            raise _RefError("." + field, problem, fix)
        if self.nodes is not None:
            if self.nodes.hosts[0] != self.host:
                raise ValueError(f"nodes.hosts[0] is the head node and must be the lane's host {self.host!r}, "
                                 f"not {self.nodes.hosts[0]!r}")
            if len(set(self.nodes.hosts)) != len(self.nodes.hosts):
                raise ValueError("nodes.hosts names a host twice; one node per host")
            if RULES[self.engine].rpc and self.nodes.link is None:
                raise ValueError("a llama.cpp lane across nodes needs nodes.link (rpc-server listens on its end)")
            if not RULES[self.engine].node_env and self.nodes.env:
                raise ValueError("nodes.env sets the environment of vLLM and SGLang node processes; llama.cpp's "
                                 "rpc-server takes none: remove nodes.env (the server's own environment is 'env')")
        needles = self.correctness.needles if self.correctness else None
        if needles is not None and needles.rungs and max(needles.rungs) > (room := self.context - needles.max_tokens):
            raise ValueError(f"needle rung {max(needles.rungs)} does not fit a context of {self.context} tokens "
                             f"per slot with {needles.max_tokens} answer tokens (at most {room})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _nodes_as_rpc(cls, data: object) -> object:
        """llama.cpp spans hosts with its RPC backend: its worker nodes are the rpc plan's workers."""
        if not isinstance(data, dict) or not RULES.get(str(data.get("engine")), LaneRules()).rpc \
                or not isinstance(data.get("nodes"), dict):
            return data
        nodes = data["nodes"]
        hosts = nodes.get("hosts")
        if not (isinstance(hosts, list) and len(hosts) >= 2 and nodes.get("link")):
            return data
        rpc = {"workers": hosts[1:], "link": nodes["link"], "port": nodes.get("port") or 50052}
        given = data.get("rpc")
        if given is not None:  # a lane dumped and read back carries the rpc plan it derived
            given = given.model_dump() if isinstance(given, BaseModel) else given
            if not isinstance(given, dict) or {k: given.get(k, rpc[k]) for k in rpc} != rpc:
                raise ValueError("give either 'nodes' or 'rpc', not both (nodes is the rpc plan's general form)")
        return {**data, "rpc": {**(given or {}), **rpc}}

    @field_validator("flags")
    @classmethod
    def _flags(cls, v: list[str]) -> list[str]:
        for flag in v:
            if not _SAFE_FLAG.fullmatch(flag):
                raise ValueError(f"flag {flag!r} has characters not allowed on a command line ($, `, ;, |, &, <, >, newline)")
        return v


class Inventory(_Strict):
    """Everything `hosts.yaml` declares, cross-checked (lanes name known hosts, links name known ends)."""

    hosts: Annotated[dict[str, Host], Field(min_length=1)]
    links: list[Link] = []
    lanes: Annotated[dict[str, Lane], Field(min_length=1)]

    def link(self, name: str) -> Link | None:
        return next((lk for lk in self.links if lk.name == name), None)

    @model_validator(mode="after")
    def _references(self) -> Inventory:
        def known(field: str, host: str) -> None:
            if host not in self.hosts:
                raise _RefError(field, f"names host {host!r}, which is not under 'hosts'", f"use one of: {', '.join(self.hosts)}")

        for name in [*self.hosts, *self.lanes]:
            if not _NAME.fullmatch(name):
                raise ValueError(f"name {name!r} must be letters, digits, '_', '.', '-' (at most 63)")
        for lane_name, lane in self.lanes.items():
            known(f"lanes.{lane_name}.host", lane.host)
        links = {link.name for link in self.links}
        for lane_name, lane in self.lanes.items():
            needed = [*lane.links, *([lane.rpc.link] if lane.rpc else [])]
            needed += [lane.nodes.link] if lane.nodes and lane.nodes.link and not RULES[lane.engine].rpc else []
            for i, name in enumerate(needed):
                if name not in links:
                    field = f"lanes.{lane_name}.links[{i}]" if i < len(lane.links) else \
                        f"lanes.{lane_name}.{'nodes' if lane.nodes else 'rpc'}.link"
                    raise _RefError(field, f"names link {name!r}, which is not under 'links'",
                                    f"use one of: {', '.join(links)}" if links else
                                    "declare the link under 'links' (name, a and b ends, mtu) or remove it")
            for i, node in enumerate(lane.nodes.hosts if lane.nodes else []):
                known(f"lanes.{lane_name}.nodes.hosts[{i}]", node)
            for i, worker in enumerate(lane.rpc.workers if lane.rpc and not lane.nodes else []):
                known(f"lanes.{lane_name}.rpc.workers[{i}]", worker)
        for i, link in enumerate(self.links):
            known(f"links[{i}].a.host", link.a.host)
            known(f"links[{i}].b.host", link.b.host)
        return self
