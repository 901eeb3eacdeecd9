"""The hosts a lane occupies, one list for every flow's host lock, preflight and `lanebench plan` (two
copies once disagreed: the KL gate did not lock a lane's nodes, so a second job booted on its rank 1)."""

from __future__ import annotations

from tasks.inventory.models import Lane


def every_host(lane: Lane) -> list[str]:
    """The lane's own host first, then its RPC workers' and its nodes' (each once)."""
    workers = lane.rpc.workers if lane.rpc else []
    nodes = lane.nodes.hosts if lane.nodes else []
    return list(dict.fromkeys([lane.host, *workers, *nodes]))
