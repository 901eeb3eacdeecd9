"""A docker lab for tests: a real registry on loopback and real dockerds, all under one short
state folder in /tmp (unix socket paths are limited), and a check that nothing is left."""

from __future__ import annotations

import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lab.docker import Daemon, Dockerd, Registry, _pids_naming, start_dockerd, start_registry
from lab.procs import alive as _alive
from lab.procs import mounts_under as _mounts_under


def free_loopback_port(candidates: range | None = None) -> int:
    """A loopback port nobody listens on: from `candidates` when given, else one the kernel picks."""
    for port in candidates or [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free loopback port in {candidates}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"


@dataclass
class DockerLab:
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lbd-", dir="/tmp")))
    daemons: list[Daemon] = field(default_factory=list)

    def registry(self, name: str = "reg") -> Registry:
        daemon = start_registry(self.root / name, "127.0.0.1", free_loopback_port())
        self.daemons.append(daemon)
        return daemon

    def dockerd(self, name: str, netns: str | None = None) -> Dockerd:
        daemon = start_dockerd(self.root / name, netns=netns)
        self.daemons.append(daemon)
        return daemon

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.stop()

    def leftovers(self) -> list[str]:
        """What a stopped lab must not leave: daemon pids, processes naming the lab, mounts."""
        left = [f"{d.name} pid {d.pid} still running" for d in self.daemons if _alive(d.pid)]
        left += [f"pid {pid}: {_cmdline(pid)}" for pid in _pids_naming(self.root) if _alive(pid)]
        left += [f"mount {m}" for m in _mounts_under(self.root)]
        return left

    def remove(self) -> None:
        if not _mounts_under(self.root):
            shutil.rmtree(self.root, ignore_errors=True)
