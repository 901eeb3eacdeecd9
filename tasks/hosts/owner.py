"""Who owns a run or a lease: this host, this boot, this process (and the process's start time).

A run folder and a host lock both name their owner so that a later process on the same host can
tell a live owner from a dead one (a recycled pid has another start time; a reboot another boot id).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


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


def owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"hostname": socket.gethostname(), "boot_id": _boot_id(), "pid": pid, "start": _start_time(pid)}


def owner_alive(o: dict[str, Any]) -> bool | None:
    """True/False for an owner on this host (this boot); None when it cannot be judged from here."""
    if not o or o.get("hostname") != socket.gethostname():
        return None
    if o.get("boot_id") != _boot_id():
        return False  # the machine rebooted since: nothing of that run survives
    return bool(o.get("pid")) and _start_time(int(o["pid"])) == o.get("start")
