"""Who listens on a lane's port: the server lanebench started, or an impostor.

Issue 27: another process took the lane's port between preflight and boot; llama-server exited
(`couldn't bind HTTP server socket`) and lanebench measured the impostor. So before each health
request boot asks the host who owns the listening socket: its inode from /proc/net/tcp{,6}, then
the process whose fd links to `socket:[inode]`. One `sh` script, run here, over SSH or inside the
lane's container (host network), so every transport answers alike. Another user's socket shows
no owner we can see: never ours, since the server runs as us.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel


class Runs(Protocol):
    """A transport, structurally: transport.py calls this module back, so neither imports the other."""

    def run(self, argv: list[str], *, deadline_s: float = ..., idempotent: bool = ...) -> Any: ...

# $1 = port. Prints "inode N" per listening socket on the port, then "pid PID PGID COMM" per owner
# whose fds we can read. Fields of /proc/PID/stat after "(comm) ": state ppid pgrp.
LISTENER_SCRIPT = r'''
for c in awk find sed cut sort; do command -v "$c" >/dev/null 2>&1 || { echo "no $c" >&2; exit 3; }; done
p=$(printf ':%04X' "$1")
for i in $(awk -v p="$p" '$4 == "0A" && substr($2, length($2) - 4) == p { print $10 }' \
           /proc/net/tcp /proc/net/tcp6 2>/dev/null | sort -u); do
  echo "inode $i"
  for fd in $(find /proc/[0-9]*/fd -lname "socket:\[$i\]" 2>/dev/null); do
    pid=${fd#/proc/}; pid=${pid%%/*}
    g=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f3)
    echo "pid $pid ${g:-0} $(cat "/proc/$pid/comm" 2>/dev/null)"
  done
done
exit 0
'''


class Owner(BaseModel):
    pid: int
    pgid: int
    comm: str


class Listeners(BaseModel):
    """The listening sockets on one port and the owners we can see."""

    port: int
    sockets: int = 0
    owners: list[Owner] = []

    def describe(self) -> str:
        if not self.owners:
            return f"port {self.port} is held by a process lanebench cannot see (another user's)"
        who = ", ".join(f"pid {o.pid} ({o.comm})" for o in self.owners)
        return f"port {self.port} is held by {who}"


def listeners(transport: Runs, port: int, prefix: list[str] | None = None) -> Listeners | None:
    """Ask the host (or, with `prefix` such as `docker exec NAME`, a container) who listens on `port`.
    None when it cannot be asked there (no `sh`, `awk` or `find` in an image): boot then goes by
    health alone rather than never booting."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    r = transport.run([*(prefix or []), "sh", "-c", LISTENER_SCRIPT, "sh", str(port)], deadline_s=30.0, idempotent=True)
    if r.exit_code != 0:
        return None
    found = Listeners(port=port)
    for line in r.stdout.splitlines():
        parts = line.split(maxsplit=3)
        if parts[:1] == ["inode"]:
            found.sockets += 1
        elif parts[:1] == ["pid"] and len(parts) >= 3 and parts[1].isdigit() and parts[2].isdigit():
            found.owners.append(Owner(pid=int(parts[1]), pgid=int(parts[2]), comm=parts[3] if len(parts) > 3 else "?"))
    return found
