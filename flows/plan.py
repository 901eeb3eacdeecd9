"""`lanebench plan [--hosts FILE] [LANE...]`: every process the lanes would start, run nothing.

Users check a new lane with it before a night: per lane the host of every node, container or
bare, the full argv, the ports, the preflight checks that would skip it, the boot facts and
gates that will be checked, the running-request cap its config implies against its bench,
and launch flags the pinned engine release does not define. Nothing is started, no host is
contacted; a model file on this machine is looked at. Exit 0 when every lane would run
(skips included, with the reason), 1 when a lane would fail a gate for sure or emits a flag
its release lacks, 2 on bad input.
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
from tasks.inventory.models import ConfigError, CounterGate, Inventory, Lane
from tasks.stages import topology


class Process(BaseModel):
    role: str  # "head (node 0)", "node 1", "rpc-server"
    host: str
    address: str
    where: str  # "bare" or "container <image>"
    argv: list[str]
    ports: list[int]


class LanePlan(BaseModel):
    lane: str
    engine: str
    processes: list[Process]
    preflight: list[str]
    facts: list[str]
    gates: list[str]
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
    """The lane as its head host serves it, by the lane flow's own function (model paths there,
    agentic and rpc flags added), with the rpc endpoints the inventory implies."""
    from tasks.stages.preflight import Preflight
    from tasks.stages.serve import resolved

    pre = Preflight(ok=True, rpc_endpoints=topology.rpc_endpoints(lane, inventory))
    return resolved(lane, inventory.hosts[lane.host], base_dir, pre)


def _processes(lane: Lane, inventory: Inventory) -> list[Process]:
    engine = engine_for(lane.engine)
    host = inventory.hosts[lane.host]
    where = f"container {lane.image}" if lane.image else "bare"
    master = topology.master_address(lane, inventory)
    head_ports = [lane.port] + ([topology.rendezvous_port(lane)] if topology.spans_nodes(lane) else [])
    out = [Process(role="head (node 0)" if lane.nodes else "server", host=lane.host, address=host.address, where=where,
                   argv=engine.launch_command(topology.at_rank(lane, engine, 0, master), _binary(lane), host.address),
                   ports=head_ports)]
    for rank, name in topology.worker_ranks(lane):
        address = inventory.hosts[name].address
        out.append(Process(role=f"node {rank}", host=name, address=address, where=where,
                           argv=engine.launch_command(topology.at_rank(lane, engine, rank, master), _binary(lane), address),
                           ports=[]))
    if lane.rpc is not None:
        for worker, endpoint in zip(lane.rpc.workers, topology.rpc_endpoints(lane, inventory)):
            address, port = endpoint.rsplit(":", 1)
            binary = lane.rpc.binary or "rpc-server"
            out.append(Process(role="rpc-server", host=worker, address=address, where="bare",
                               argv=engine.rpc_worker_command(binary, address, int(port), lane.threads), ports=[int(port)]))
    return out


def _preflight(lane: Lane, inventory: Inventory) -> list[str]:
    out = []
    for name in [*lane.links, *([lane.rpc.link] if lane.rpc else []), *([lane.nodes.link] if lane.nodes and lane.nodes.link else [])]:
        link = next(lk for lk in inventory.links if lk.name == name)
        need = ", ".join(x for x in (f"MTU {link.mtu}" if link.mtu else "", f">= {link.min_gbps:g} Gb/s" if link.min_gbps else "") if x)
        out.append(f"link {name}: {link.a.host} {link.a.interface} {link.a.address} <-> {link.b.host} "
                   f"{link.b.interface} {link.b.address} up and reachable{', ' + need if need else ''}")
    nodes = lane.nodes.hosts if lane.nodes else [lane.host, *(lane.rpc.workers if lane.rpc else [])]
    for name in dict.fromkeys(nodes):
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
    out = []
    for gate in lane.gates:
        if isinstance(gate, CounterGate):
            source = f"metric {gate.metric} increase over a probe" if gate.metric else f"log /{gate.log_pattern}/"
            out.append(f"counter {gate.name}: {source} {gate.op} {gate.threshold:g}")
        else:
            out.append(f"capacity: bench concurrency up to {max(lane.bench.decode.gated_levels())} must fit the "
                       "running-request cap the server resolves (the lowest of its sources)")
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
            ports = f", ports {', '.join(map(str, proc.ports))}" if proc.ports else ""
            lines.append(f"  {proc.role} on {proc.host} ({proc.address}), {proc.where}{ports}")
            lines.append(f"    {shlex.join(proc.argv)}")
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
        inventory = load_inventory(hosts)
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
    from tasks.engines.build import REPO

    p = subparsers.add_parser("plan", help="print every process the lanes would start, and what they check; run nothing")
    p.add_argument("--hosts", default=str(REPO / "hosts.yaml"), help="inventory file (default: the shipped hosts.yaml)")
    p.add_argument("lanes", nargs="*", metavar="LANE", help="plan only these lanes (default: every lane)")
    p.add_argument("--json", action="store_true", help="the plan as JSON (one object per lane)")
    p.set_defaults(func=cmd_plan)
