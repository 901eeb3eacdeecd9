"""Who runs what where: a lane's processes across its nodes, decided from the inventory alone.

Shared by boot and `lanebench plan`, so the plan a user reads is the command line the night runs.
Rank 0 is the head on the lane's host (HTTP); ranks 1.. run the engine's worker process (vLLM
`--headless`, SGLang `--node-rank r`; llama.cpp uses `rpc-server`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tasks.engines import Engine, engine_for
from tasks.inventory.models import Host, Inventory, Lane


def master_address(lane: Lane, inventory: Inventory) -> str:
    """Where the node group rendezvous: the head's end of `nodes.link`, else the head's address."""
    link = inventory.link(lane.nodes.link) if lane.nodes is not None and lane.nodes.link is not None else None
    end = link.end(lane.host) if link is not None else None
    return end.address if end is not None else inventory.hosts[lane.host].address


RENDEZVOUS_PORT = 29501  # vLLM's --master-port default (vllm/config/parallel.py); SGLang takes it too


def rendezvous_port(lane: Lane) -> int:
    return (lane.nodes.port if lane.nodes else None) or RENDEZVOUS_PORT


def spans_nodes(lane: Lane) -> bool:
    """A multi-node lane whose engine takes node flags (llama.cpp spans nodes with rpc-server)."""
    return lane.nodes is not None and not engine_for(lane.engine).spans_nodes_by_rpc


def at_rank(lane: Lane, engine: Engine, rank: int, master: str) -> Lane:
    """The lane as node `rank` launches it: its flags plus the engine's node flags (last, so they win)."""
    if not spans_nodes(lane):
        return lane
    assert lane.nodes is not None
    flags = [*lane.flags, *engine.node_flags(rank, len(lane.nodes.hosts), master, rendezvous_port(lane))]
    return lane.model_copy(update={"flags": flags})


def launch_argv(lane: Lane, engine: Engine, binary: str, address: str, host: Host) -> list[str]:
    """The engine's launch command, with the offload the host's `gpus` implies (`gpus: 0` keeps a CUDA
    build on the CPU); with RPC workers the layers go to them instead."""
    argv = engine.launch_command(lane, binary, address)
    if lane.rpc is None:
        argv += engine.offload_flags(host.gpus, lane.drafter is not None, lane.flags)
    return argv


def node_env(lane: Lane, host_name: str) -> dict[str, str]:
    """The environment of the lane's process on `host_name`: `env`, with `nodes.env[host]` over it."""
    return {**lane.env, **(lane.nodes.env.get(host_name, {}) if lane.nodes is not None else {})}


def key_env(engine: Engine, key: str | None) -> dict[str, str]:
    """The head's API key in the engine's own variable (never an argv flag: tasks/inventory/api_key.py)."""
    return {engine.api_key_env: key} if key is not None and engine.api_key_env is not None else {}


def node_ports(lane: Lane, engine: Engine, rank: int, argv: list[str]) -> list[tuple[int, str]]:
    """(port, what listens there) of node `rank`: the head's HTTP and rendezvous, plus the engine's own."""
    out: list[tuple[int, str]] = [(lane.port, "HTTP")] if rank == 0 else []
    if rank == 0 and spans_nodes(lane):
        out.append((rendezvous_port(lane), "rendezvous"))
    return out + engine.listen_ports(argv, rank, spans_nodes(lane))


def working_directory(host: Host, image: str | None, local_cwd: str) -> str:
    """Where the process starts: transports never change directory, so lanebench's own (local), the
    login directory (remote) or the image's WORKDIR."""
    if image is not None:
        return "the image's WORKDIR"
    return local_cwd if host.transport == "local" else f"the login directory of {host.user or 'the ssh user'} (~)"


def worker_ranks(lane: Lane) -> list[tuple[int, str]]:
    """(rank, host) of every node but the head."""
    return list(enumerate(lane.nodes.hosts))[1:] if spans_nodes(lane) and lane.nodes else []


def rpc_endpoints(lane: Lane, inventory: Inventory) -> list[str]:
    """llama.cpp: each rpc worker's "address:port" on its end of the rpc link (what `--rpc` lists)."""
    if lane.rpc is None:
        return []
    link = inventory.link(lane.rpc.link)
    ends = {w: link.end(w) if link is not None else None for w in lane.rpc.workers}
    return [f"{end.address if end else inventory.hosts[w].address}:{lane.rpc.port}" for w, end in ends.items()]


@dataclass(frozen=True)
class Binaries:
    """The executables a lane's processes start: the head's, each bare worker node's and each rpc-server's, by host."""

    head: str
    nodes: Mapping[str, str] = field(default_factory=dict)
    rpc: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Launch:
    """One process of a lane, as boot starts it and `lanebench plan` prints it."""

    role: str  # "server", "head (node 0)", "node 1", "rpc-server"
    host_name: str
    host: Host
    address: str  # where it listens: its host's address; an rpc-server, its end of the rpc link
    argv: list[str]
    env: dict[str, str]
    rank: int | None  # None: an rpc-server


def launches(lane: Lane, engine: Engine, hosts: Mapping[str, Host], master: str, binaries: Binaries,
             rpc_endpoints: list[str]) -> list[Launch]:
    """Every process of the lane, the head first: node ranks (node flags, then their own host's offload) or
    llama.cpp's rpc-servers on their link ends. The one place a lane's argv and environment are built."""
    head = hosts[lane.host]
    out = [Launch("head (node 0)" if lane.nodes else "server", lane.host, head, head.address,
                  launch_argv(at_rank(lane, engine, 0, master), engine, binaries.head, head.address, head),
                  node_env(lane, lane.host), 0)]
    for rank, name in worker_ranks(lane):
        node = hosts.get(name, Host())
        binary = binaries.head if lane.image else binaries.nodes[name]
        out.append(Launch(f"node {rank}", name, node, node.address,
                          launch_argv(at_rank(lane, engine, rank, master), engine, binary, node.address, node),
                          node_env(lane, name), rank))
    for worker, endpoint in zip(lane.rpc.workers if lane.rpc else [], rpc_endpoints):
        address, port = endpoint.rsplit(":", 1)
        out.append(Launch("rpc-server", worker, hosts.get(worker, Host()), address,
                          engine.rpc_worker_command(binaries.rpc[worker], address, int(port), lane.threads), {}, None))
    return out
