"""Who owns a run folder or a host lease: host, boot id, pid and the pid's start
time, so a later process can tell a dead writer from a live one (a recycled pid has another
start time; a reboot, another boot id)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import BaseModel


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (a recycled pid has another)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class Owner(BaseModel):
    hostname: str = ""
    boot_id: str = ""
    pid: int | None = None
    start: str = ""

    @classmethod
    def here(cls) -> Owner:
        pid = os.getpid()
        return cls(hostname=socket.gethostname(), boot_id=_boot_id(), pid=pid, start=_start_time(pid))

    def alive(self) -> bool | None:
        """True/False for an owner on this host (this boot); None when it cannot be judged from here."""
        if not self.hostname or self.hostname != socket.gethostname():
            return None
        if self.boot_id != _boot_id():
            return False  # the machine rebooted since: nothing of that run survives
        return bool(self.pid) and _start_time(self.pid or 0) == self.start
