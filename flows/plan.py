"""`lanebench plan [--hosts FILE] [LANE...]`: every process the lanes would start, run nothing.

Per lane: every process (host, container or bare, argv, environment with secrets redacted, ports,
working directory) as boot builds it (tasks/stages/topology.py), the draft width the engine will
run, the preflight checks, boot facts and gates, the running-request cap its config implies, and
launch flags the pinned release does not define. No host is contacted. Exit 0 when every lane
would run (skips named), 1 when a lane would fail a gate for sure or emits an unknown flag, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tasks.engines import engine_for, planned, release_flags
from tasks.engines.releases import PINNED
from tasks.inventory.load import load_inventory
from tasks.inventory.lane_hosts import every_host
from tasks.inventory.models import ConfigError, CounterGate, Inventory, Lane
from tasks.stages import topology


class Process(BaseModel):
    role: str  # "head (node 0)", "node 1", "rpc-server"
    host: str
    address: str
    where: str  # "bare" or "container <image>"
    argv: list[str]  # secret flag values redacted
    ports: list[int]
    port_uses: list[str] = []  # what listens on each of `ports`
    env: dict[str, str] = {}  # what the process gets on top of its host's environment; secrets redacted
    cwd: str = ""


class LanePlan(BaseModel):
    lane: str
    engine: str
    processes: list[Process]
    preflight: list[str]
    facts: list[str]
    gates: list[str]
    drafting: str | None = None  # the draft width and shape the engine will run, as it resolves the argv
    capacity: str | None = None  # the config-time cap line, when the config implies one
    problems: list[str] = []  # what would fail the lane for sure
    skipped: str | None = None  # what would skip it, when known without contacting a host


_FACTS = {
    "llamacpp": ["running-request cap and context per slot: boot log `n_slots`, `n_ctx_slot`",
                 "speculation type: /slots after the first request; draft model: `loading draft model`"],
    "sglang": ["version: /server_info `version` (picks the log format: tasks/engines/sglang_boot.py)",
               "running-request cap: scheduler summary and mamba cap lines x data-parallel workers; "
               "/server_info internal_states; the lowest wins",
               "speculation type: server_args; /server_info; draft model: a second 'Load weight end' per rank; counters"],
    "vllm": ["version: /version and the engine's init line (picks the log format: tasks/engines/vllm_boot.py)",
             "running-request cap: min(max_num_seqs, KV max concurrency) x data-parallel engines",
             "speculation type: SpeculativeConfig in the init line; draft model: config, 'Loading drafter model' "
             "(V1 runner only), counters"],
}


def _binary(lane: Lane) -> str:
    if lane.image is not None:
        return lane.container.entrypoint_binary
    if lane.binary is not None:
        return lane.binary
    return engine_for(lane.engine).local_binary_name or "<no binary: set 'binary' or 'image'>"


def _resolved(lane: Lane, inventory: Inventory, base_dir: Path) -> Lane:
    """The lane as its head host serves it (the lane flow's own function), with the inventory's rpc endpoints."""
    from tasks.stages.preflight import Preflight
    from tasks.stages.serve import resolved

    pre = Preflight(ok=True, rpc_endpoints=topology.rpc_endpoints(lane, inventory))
    return resolved(lane, inventory.hosts[lane.host], base_dir, pre)


def _processes(lane: Lane, inventory: Inventory) -> list[Process]:
    """Every process of the lane as boot starts it (topology.launches), with its ports and working directory."""
    import os

    from tasks.inventory import secrets

    engine = engine_for(lane.engine)
    binaries = topology.Binaries(_binary(lane), {name: _binary(lane) for _, name in topology.worker_ranks(lane)},
                                 {w: lane.rpc.binary or "rpc-server" for w in lane.rpc.workers} if lane.rpc else {})
    out = []
    for launch in topology.launches(lane, engine, inventory.hosts, topology.master_address(lane, inventory), binaries,
                                    topology.rpc_endpoints(lane, inventory)):
        if launch.rank is None:  # an rpc-server, bare, on its end of the rpc link
            ports, image = [(lane.rpc.port if lane.rpc else 0, "rpc")], None
        else:
            ports, image = topology.node_ports(lane, engine, launch.rank, launch.argv), lane.image
        env = dict(launch.env)
        if launch.rank == 0 and (lane.api_key_env or lane.api_key_file):  # the key boot puts there, never shown
            env |= topology.key_env(engine, secrets.REDACTED)
        out.append(Process(role=launch.role, host=launch.host_name, address=launch.address,
                           where=f"container {image}" if image else "bare",
                           argv=secrets.redact_argv(lane, launch.argv), ports=[p for p, _ in ports],
                           port_uses=[u for _, u in ports], env=secrets.redact_env(lane, env),
                           cwd=topology.working_directory(launch.host, image, os.getcwd())))
    return out


def _drafting(lane: Lane, argv: list[str]) -> str | None:
    """K as the engine will run it (tasks/engines/facts.py DraftPlan), in the plan's words."""
    if lane.speculative is None:
        return None
    plan = engine_for(lane.engine).draft_plan(argv)
    if plan is None:
        return f"{lane.speculative.method}, K={lane.speculative.k} draft tokens per verification step"
    k = f"K={plan.k}" if plan.k is not None else "K picked at boot"
    tree = "; per-position rates mean 'accepted path at least i+1 long'" if plan.tree else ""
    return f"{plan.method}, {k} draft tokens per verification step ({plan.flag}), {plan.shape}{tree}"


def _preflight(lane: Lane, inventory: Inventory) -> list[str]:
    out = []
    for name in [*lane.links, *([lane.rpc.link] if lane.rpc else []), *([lane.nodes.link] if lane.nodes and lane.nodes.link else [])]:
        link = next(lk for lk in inventory.links if lk.name == name)
        need = ", ".join(x for x in (f"MTU {link.mtu}" if link.mtu else "", f">= {link.min_gbps:g} Gb/s" if link.min_gbps else "") if x)
        out.append(f"link {name}: {link.a.host} {link.a.interface} {link.a.address} <-> {link.b.host} "
                   f"{link.b.interface} {link.b.address} up and reachable{', ' + need if need else ''}")
    for name in every_host(lane):
        host = inventory.hosts[name]
        parts = [f"host {name} ({host.transport} {host.address}) answers"]
        if lane.image:
            parts.append(f"docker answers and holds (or pulls) {lane.image}")
        if name == lane.host or topology.spans_nodes(lane):
            parts.append("model files present with the declared bytes/sha256")
        out.append(", ".join(parts))
    out.append(f"port {lane.port} free on {lane.host}")
    return out


def _gates(lane: Lane) -> list[str]:
    """The gates boot will run: declared and implied (tasks/stages/safety.py), as the lane flow does."""
    from tasks.stages.safety import implied_gates, waived

    engine = engine_for(lane.engine)
    out = []
    for gate in implied_gates(lane, engine):
        if isinstance(gate, CounterGate):
            source = f"metric {gate.metric} increase over a probe" if gate.metric else f"log /{gate.log_pattern}/"
            out.append(f"counter {gate.name}: {source} {gate.op} {gate.threshold:g}")
        else:
            out.append(f"capacity: bench concurrency up to {max(lane.bench.decode.gated_levels())} must fit the "
                       "running-request cap the server resolves (the lowest of its sources)")
    if lane.drafter is not None and engine.draft_counter is not None and lane.speculative is not None \
            and not waived(lane, "draft-width"):
        out.append(f"draft-width (implied): the server's draft tokens per verification step over the probe "
                   f"must be K={lane.speculative.k}")
    if lane.agentic is not None:
        out.append("agentic smoke: tool calls and reasoning as declared" +
                   (f"; thinking switch {', '.join(t.name for t in lane.agentic.thinking_switch)}" if lane.agentic.thinking_switch else ""))
    if lane.correctness is not None:
        out.append("after the measurements: " + ", ".join(
            n for n, on in (("tool gate", lane.correctness.tool_gate), ("needle ladder", lane.correctness.needles)) if on))
    return out


def plan_lane(name: str, lane: Lane, inventory: Inventory, base_dir: Path) -> LanePlan:
    resolved = _resolved(lane, inventory, base_dir)
    engine = engine_for(lane.engine)
    result = LanePlan(lane=name, engine=lane.engine, processes=_processes(resolved, inventory),
                      preflight=_preflight(lane, inventory), facts=_FACTS[lane.engine], gates=_gates(lane))
    result.drafting = _drafting(lane, result.processes[0].argv)
    cap = engine.planned_cap(lane)
    if cap is not None:
        wanted = max(lane.bench.decode.gated_levels())
        verdict = "passes" if cap.cap >= wanted else "FAILS"
        result.capacity = f"at most {cap.cap} running requests ({cap.reason}) for bench concurrency up to {wanted}: {verdict}"
    if (reason := planned.check(lane, cap)) is not None:
        result.problems.append(f"capacity gate: {reason}")
    if lane.engine in PINNED and (known := release_flags.load(lane.engine, PINNED[lane.engine])) is not None:
        for proc in result.processes:
            if proc.role == "rpc-server":
                continue
            for flag in dict.fromkeys(release_flags.unknown_flags(proc.argv, known)):
                result.problems.append(f"{proc.role} on {proc.host}: flag {flag} is not defined by "
                                       f"{lane.engine} {known.version} (tasks/engines/flags/)")
    if lane.image is None and lane.binary is None and engine_for(lane.engine).local_binary_name is None:
        result.skipped = f"lane declares no binary for engine {lane.engine} (set 'binary', or run it from a pinned 'image')"
    elif inventory.hosts[lane.host].transport == "local":
        for role, ref in (("model", resolved.model), ("drafter", resolved.drafter)):
            if ref is not None and not Path(ref.path).exists():
                result.skipped = f"{role} file {ref.path} is missing"
                break
    return result


def render(plans: list[LanePlan]) -> str:
    lines = []
    for p in plans:
        lines.append(f"lane {p.lane} ({p.engine}, {len(p.processes)} process{'es' if len(p.processes) > 1 else ''})")
        for proc in p.processes:
            uses = proc.port_uses if len(proc.port_uses) == len(proc.ports) else [""] * len(proc.ports)
            ports = ", ".join(f"{port} ({use})" if use else str(port) for port, use in zip(proc.ports, uses))
            lines.append(f"  {proc.role} on {proc.host} ({proc.address}), {proc.where}"
                         f"{', ports ' + ports if ports else ''}")
            lines.append(f"    argv: {shlex.join(proc.argv)}")
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in proc.env.items())
            lines.append(f"    env: {env or '(none beyond the host environment)'}")
            lines.append(f"    working directory: {proc.cwd}")
        if p.drafting:
            lines.append(f"  drafting: {p.drafting}")
        lines += ["  preflight (a failure skips the lane):", *(f"    {x}" for x in p.preflight)]
        lines += ["  boot facts read:", *(f"    {x}" for x in p.facts)]
        lines += ["  gates:", *(f"    {x}" for x in p.gates or ["none declared"])]
        if p.capacity:
            lines.append(f"  config-time capacity: {p.capacity}")
        lines += [f"  WOULD FAIL: {x}" for x in p.problems]
        lines.append(f"  would be skipped: {p.skipped}" if p.skipped else "  would be skipped: not for any reason known "
                     "before preflight")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from flows.cli import _bad_input

    hosts = Path(args.hosts)
    try:
        inventory = load_inventory(hosts, engine_for)
    except ConfigError as e:
        return _bad_input(str(e))
    unknown = [name for name in args.lanes if name not in inventory.lanes]
    if unknown:
        return _bad_input(f"{unknown[0]}: no such lane in {hosts}. Fix: use one of: {', '.join(inventory.lanes)}")
    names = args.lanes or list(inventory.lanes)
    plans = [plan_lane(name, inventory.lanes[name], inventory, hosts.resolve().parent) for name in names]
    print(json.dumps([p.model_dump() for p in plans], indent=1) if args.json else render(plans))
    return 1 if any(p.problems for p in plans) else 0


def register_cli(subparsers: Any) -> None:
    from tasks.inventory.paths import REPO

    p = subparsers.add_parser("plan", help="print every process the lanes would start, and what they check; run nothing")
    p.add_argument("--hosts", default=str(REPO / "hosts.yaml"), help="inventory file (default: the shipped hosts.yaml)")
    p.add_argument("lanes", nargs="*", metavar="LANE", help="plan only these lanes (default: every lane)")
    p.add_argument("--json", action="store_true", help="the plan as JSON (one object per lane)")
    p.set_defaults(func=cmd_plan)
