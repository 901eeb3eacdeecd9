"""Network namespaces, veth pairs and a bridge, made and removed with iproute2 (`ip`, argv lists).

The lab's hosts are network namespaces on this machine. Every address set here is one of
the lab's own (10.213.0.0/24 management, 10.213.1.0/30 direct link); no namespace gets a
default route, so nothing the lab runs can send traffic anywhere else.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from pathlib import Path

_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
NETNS_DIR = Path("/run/netns")


class NetnsError(RuntimeError):
    """An `ip` command failed: carries the command and what it said."""


def _name(value: str) -> str:
    if not _IFNAME.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid namespace or interface name")
    return value


def _cidr(value: str) -> str:
    ipaddress.ip_interface(value)  # raises ValueError on anything else
    return value


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip [-n NS] ARGS...`; raise NetnsError with its stderr when `check` and it fails."""
    argv = ["ip", *(["-n", _name(netns)] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def list_netns() -> list[str]:
    done = ip("-j", "netns", "list", check=False)
    return [entry["name"] for entry in json.loads(done.stdout)] if done.returncode == 0 and done.stdout.strip() else []


def add_netns(name: str) -> None:
    """A fresh namespace with loopback up."""
    ip("netns", "add", _name(name))
    ip("link", "set", "lo", "up", netns=name)


def del_netns(name: str) -> bool:
    """Remove a namespace (its interfaces and their veth peers go with it); False when absent."""
    if present := _name(name) in list_netns():
        ip("netns", "del", name)
    return present


def netns_inode(name: str) -> int | None:
    """The nsfs inode of a named namespace, to find the processes running in it."""
    try:
        return os.stat(NETNS_DIR / _name(name)).st_ino
    except OSError:
        return None


def link_exists(ifname: str, netns: str | None = None) -> bool:
    return ip("link", "show", "dev", _name(ifname), netns=netns, check=False).returncode == 0


def del_link(ifname: str, netns: str | None = None) -> bool:
    """Remove a link; False when absent. A veth whose peer's namespace was just deleted vanishes a
    moment later (namespaces are torn down asynchronously): only a link still there after a failed
    `del` is an error."""
    if present := link_exists(ifname, netns):
        try:
            ip("link", "del", "dev", _name(ifname), netns=netns)
        except NetnsError:
            if link_exists(ifname, netns):
                raise
    return present


def add_bridge(name: str, cidr: str) -> None:
    ip("link", "add", "name", _name(name), "type", "bridge")
    ip("addr", "add", _cidr(cidr), "dev", name)
    ip("link", "set", name, "up")


def add_veth_to_bridge(root_end: str, bridge: str, netns: str, ns_end: str, cidr: str, mtu: int | None = None) -> None:
    """A veth pair: `root_end` enslaved to `bridge` here, `ns_end` inside `netns` holding `cidr`."""
    ip("link", "add", _name(root_end), "type", "veth", "peer", "name", _name(ns_end), "netns", _name(netns))
    ip("link", "set", root_end, "master", _name(bridge))
    ip("link", "set", root_end, "up")
    _address_up(netns, ns_end, cidr, mtu)


def add_veth_between(ns_a: str, if_a: str, cidr_a: str, ns_b: str, if_b: str, cidr_b: str, mtu: int | None = None) -> None:
    """A direct cable: a veth pair with one end in each namespace."""
    ip("link", "add", _name(if_a), "type", "veth", "peer", "name", _name(if_b), "netns", _name(ns_b), netns=ns_a)
    _address_up(ns_a, if_a, cidr_a, mtu)
    _address_up(ns_b, if_b, cidr_b, mtu)


def _address_up(netns: str, ifname: str, cidr: str, mtu: int | None) -> None:
    if mtu is not None:
        ip("link", "set", ifname, "mtu", str(int(mtu)), netns=netns)
    ip("addr", "add", _cidr(cidr), "dev", ifname, netns=netns)
    ip("link", "set", ifname, "up", netns=netns)


def set_link(ifname: str, up: bool, netns: str | None = None) -> None:
    ip("link", "set", _name(ifname), "up" if up else "down", netns=netns)


def operstate(ifname: str, netns: str | None = None) -> str | None:
    done = ip("-j", "link", "show", "dev", _name(ifname), netns=netns, check=False)
    return json.loads(done.stdout)[0].get("operstate") if done.returncode == 0 else None
