"""The transport a host's config asks for: here, or over SSH (paramiko is imported only for SSH hosts);
and a lane's `Reach`, the transports its preflight, image pull and boot use."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tasks.hosts.links import lane_links
from tasks.hosts.transport import LocalTransport, Transport
from tasks.inventory.lane_hosts import every_host
from tasks.inventory.models import Host, Inventory, Lane


def transport_for(host_name: str, host: Host, base_dir: Path) -> Transport:
    """The transport a host's config asks for (paramiko is imported only for SSH hosts)."""
    if host.transport == "local":
        return LocalTransport(host_name)
    from tasks.hosts.ssh import SSHTransport

    return SSHTransport.from_host(host_name, host, base_dir)


@dataclass
class Reach:
    """The transports a lane's preflight, image pull and boot use: its host's, its workers' and its links' ends."""

    host_name: str
    transports: dict[str, Transport] = field(default_factory=dict)

    @property
    def transport(self) -> Transport:
        return self.transports[self.host_name]

    @classmethod
    def of(cls, host_name: str, lane: Lane, host: Host, base_dir: Path, inventory: Inventory | None) -> Reach:
        hosts = {host_name: host}
        if inventory is not None:  # its RPC workers and nodes (the hosts its lock holds), its links' ends
            ends = [h for link in inventory.links if link.name in lane_links(lane) for h in (link.a.host, link.b.host)]
            hosts |= {name: inventory.hosts[name] for name in [*every_host(lane)[1:], *ends]}
        return cls(host_name, {name: transport_for(name, h, base_dir) for name, h in hosts.items()})

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
