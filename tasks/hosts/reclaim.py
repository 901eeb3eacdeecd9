"""Reclaim what a dead run left on a host: its server, its RPC workers, its container.

A lanebench killed mid-run leaves its server listening, and the next nightly would skip the lane
(port taken). Every spawn records its process group in a pidfile named after lane and port
(`PIDFILE_DIR`), every engine container carries the lane's label; a lane holds its host's lock
before it gets here, so what those name belongs to a gone run: stopped, with a line, before
preflight looks at the port.
"""

from __future__ import annotations

from tasks.hosts import containers
from tasks.hosts.transport import Transport, TransportError
from tasks.inventory.models import Host, Lane


def server_spawn_name(lane_name: str, lane: Lane) -> str:
    """The pidfile name a lane's server is spawned under (tasks/stages/boot.py)."""
    return f"{lane_name}.{lane.port}"


def reclaim_leftovers(lane_name: str, lane: Lane, host: Host, transports: dict[str, Transport],
                      host_name: str) -> list[str]:
    """Stop a dead run's server, workers and container for this lane; one line each. An unreachable
    host is left to preflight, which says so."""
    lines: list[str] = []
    main = transports.get(host_name)
    try:
        if main is not None and lane.image is not None:
            if containers.remove_leftover(main, host.docker_host, lane_name):
                lines.append(f"reclaimed: container {containers.container_name(lane_name)} of a dead run "
                             f"removed on {host_name}")
        elif main is not None and main.stop_leftover(server_spawn_name(lane_name, lane)):
            lines.append(f"reclaimed: a dead run's server for lane {lane_name} (port {lane.port}) stopped on "
                         f"{host_name} (pidfile {server_spawn_name(lane_name, lane)}.pid)")
        for i, worker in enumerate(lane.rpc.workers if lane.rpc else []):
            t = transports.get(worker)
            if t is not None and t.stop_leftover(f"{lane_name}-rpc{i}.{lane.port}"):
                lines.append(f"reclaimed: a dead run's RPC worker for lane {lane_name} stopped on {worker}")
    except (TransportError, OSError) as e:
        lines.append(f"reclaim on {host_name} not done: {e}")
    except Exception as e:  # a container refused (not ours) is preflight's to report
        lines.append(f"reclaim on {host_name} not done: {type(e).__name__}: {e}")
    return lines
