"""The transport a host's config asks for: here, or over SSH (paramiko is imported only for SSH hosts)."""

from __future__ import annotations

from pathlib import Path

from tasks.hosts.transport import LocalTransport, Transport
from tasks.inventory.models import Host


def transport_for(host_name: str, host: Host, base_dir: Path) -> Transport:
    """The transport a host's config asks for (paramiko is imported only for SSH hosts)."""
    if host.transport == "local":
        return LocalTransport(host_name)
    from tasks.hosts.ssh import SSHTransport

    return SSHTransport.from_host(host_name, host, base_dir)
