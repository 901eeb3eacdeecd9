"""The hosts a lane occupies: one list, whichever flow runs the lane.

Its host lock holds them (the nightly, tools, matrix arms and the KL gate alike), its preflight
reaches them and `lanebench plan` checks them. Two copies of this list once disagreed: the KL
gate locked the lane's host and its RPC workers but not its nodes, so a second job could boot
on the node a lane across hosts was running rank 1 on.
"""

from __future__ import annotations

from tasks.inventory.models import Lane


def every_host(lane: Lane) -> list[str]:
    """The lane's own host first, then its RPC workers' and its nodes' (each once)."""
    workers = lane.rpc.workers if lane.rpc else []
    nodes = lane.nodes.hosts if lane.nodes else []
    return list(dict.fromkeys([lane.host, *workers, *nodes]))
